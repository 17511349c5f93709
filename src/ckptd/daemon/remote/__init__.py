"""The remote tier: one fsspec adapter, its backends, the key layout, the drain and fetches."""
