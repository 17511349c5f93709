"""PyTorch Distributed Checkpoint (DCP) through ckptd.

``dcp.save(state, checkpoint_id=N, storage_writer=CkptdWriter("run-42"))`` hands
each rank's shards to the node daemon over shared memory (one copy, no
serialisation of tensors) as ckptd step ``N``; ``dcp.load(state,
checkpoint_id=N, storage_reader=CkptdReader("run-42"))`` reads them back from
the daemon's verified restore memory, onto any number of ranks. ``async_save``
works with both of DCP's executors (the process executor needs a writer made
from a job name). A checkpoint id is a step: ``N``, ``"N"`` or
``"ckptd://<job>/<N>"``.

Importing this module imports torch; ``import ckptd.client`` does not.
"""

from .common import is_checkpoint_id, parse_checkpoint_id
from .reader import CkptdReader
from .writer import CkptdWriter

__all__ = ["CkptdReader", "CkptdWriter", "is_checkpoint_id", "parse_checkpoint_id"]
