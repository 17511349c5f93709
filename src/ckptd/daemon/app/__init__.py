"""The process: typed config, the composition root, supervision, ``ckptd serve`` and the CLI."""
