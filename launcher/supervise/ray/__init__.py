"""The Ray backend and its checkpoints on the nodes: `RayBackend` (driver.py) places one
actor per GPU and moves each GPU's handle through handle.py's table; `RayCustodian`
(copies.py) keeps the checkpoints where they are, on the nodes (node.py: the actor, its
process host and its checkpoints). Imports nothing: the nodes import its modules by name.
"""
