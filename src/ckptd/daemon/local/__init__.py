"""The local tier: shared-memory leases, the NVMe store, the save path to LOCAL,
admission, the newest committed steps kept in shared memory (the memory tier:
memory.py), and the rank files pre-staged in shared memory for restores (prestaged.py)."""
