"""The local tier: shared-memory leases, the NVMe store, the save path to LOCAL,
admission, and the rank files pre-staged in shared memory for restores (prestaged.py)."""
