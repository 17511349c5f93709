"""The local tier: shared-memory leases, the NVMe store, the save path to LOCAL, admission."""
