"""Leaf kinds of a framework that the generic tree and save code handle: jax arrays
as shards (jax_arrays.py), torch tensors as arrays and back (torch_tensors.py), the
facts about a leaf on a device (device.py), and CUDA tensors' and GPU jax arrays'
copies from the device straight into a lease (torch_device.py).

Each module here imports its framework only once the program has imported it, and
the generic code (tree/, copy_plan.py, saver.py) reaches the frameworks only through
this room; nothing here imports the client's higher rooms (torch/'s DCP classes, the
framework integrations), so the generic code never reaches up to them.
"""
