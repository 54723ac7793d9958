"""`fractus-pod dashboard` (server.py) and `fractus-pod plot` (plot.py): the pod's curves
from its files, read-only. series.py reads the metrics files, timeline.py the events."""
