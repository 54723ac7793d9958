"""The Ray backend (`RayBackend`, driver.py) and its checkpoints on the nodes
(`RayCustodian`, copies.py). Imports nothing: the nodes import its modules by name.
"""
