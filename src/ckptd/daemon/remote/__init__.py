"""The remote tier: one fsspec adapter, its backends, the key layout, publish, retract and fetch."""
