"""The remote tier: one fsspec adapter, its backends, the key layout, publish, retract,
read, and the bucket as a restore's tier (source.py)."""
