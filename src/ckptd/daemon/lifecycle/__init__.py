"""A step's life after its commit: the drain to the bucket, the evictor that applies
retention's plan to each tier, and pins. Above the tiers, which it moves steps between."""
