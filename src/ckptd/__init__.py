"""ckptd: a per-node checkpoint daemon and the client library trainers call.

``ckptd.client`` is what a training process imports; ``ckptd.daemon`` is the
daemon (``ckptd serve``); ``ckptd.core`` holds what both sides share (errors,
the manifest format, checksums); ``ckptd.proto`` is the generated wire layer.
"""
