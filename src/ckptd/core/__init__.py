"""ckptd.core: what the client and the daemon share: the on-disk format, names,
errors and their one mapping, checksums, and the connection to the daemon."""
