"""Leaf kinds of a framework that the generic tree and save code handle: torch
tensors as arrays and back (torch_tensors.py), and CUDA tensors' and GPU jax arrays'
copies from the device straight into a lease (torch_device.py).

Each module here imports its framework, and the generic code (tree_spec.py,
tree_match.py, copy_plan.py, saver.py) imports it only once the program has imported
that framework itself; nothing here imports the client's higher rooms (torch/'s DCP
classes, the framework integrations), so the generic code never reaches up to them.
"""
