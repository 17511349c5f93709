"""The generic tree code: a user's nested state as leaves and back, whatever
framework made it.

nodes.py walks containers (dicts, lists, tuples, dataclasses, named tuples) and
names each leaf's path; spec.py flattens a tree into the leaves a save writes and
the spec that rebuilds it; match.py matches a restore's target tree against a
step's spec. The leaf kinds of a framework (torch tensors, jax arrays, device
copies) live in ``leaves/``, which this room imports only once the program has
imported that framework itself.
"""
