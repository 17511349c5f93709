"""Generated gRPC/protobuf stubs for the ckptd wire API (``proto/ckptd/v1/ckptd.proto``).

The stubs are checked in; ``make proto`` regenerates them and a test fails if
they drift from the .proto.
"""

PROTOCOL_VERSION = 1
"""Major version of the wire protocol; sent by clients in ``ckptd-protocol-version``."""

PROTOCOL_HEADER = "ckptd-protocol-version"


def state_name(state: int) -> str:
    """A SaveState without its prefix (``LOCAL``, ``FAILED``), as logs and tables show it;
    a number no SaveState has (a newer or broken client's) as ``UNKNOWN(7)``."""
    from . import ckptd_pb2

    if state not in ckptd_pb2.SaveState.values():
        return f"UNKNOWN({state})"
    return ckptd_pb2.SaveState.Name(state).removeprefix("SAVE_STATE_")
