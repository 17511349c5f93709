"""Regenerate the Python stubs for ``proto/ckptd/v1/ckptd.proto``.

``python -m ckptd.proto.generate [OUT_DIR]`` writes ``ckptd_pb2.py``,
``ckptd_pb2.pyi`` and ``ckptd_pb2_grpc.py``. The .proto is mapped to the
virtual path ``ckptd/proto/ckptd.proto`` so the generated gRPC module imports
``ckptd.proto.ckptd_pb2`` (the package it ships in) rather than a bare name.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
"""Where the stubs live (``src/ckptd/proto``: the ``ckptd.proto`` package)."""
PROTO_FILE = PROTO_DIR.parents[2] / "proto" / "ckptd" / "v1" / "ckptd.proto"
"""The schema, at the repository's ``proto/ckptd/v1/`` (a clone, not an installed wheel)."""
GENERATED = ("ckptd_pb2.py", "ckptd_pb2.pyi", "ckptd_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) and copy the three stubs into ``out_dir``."""
    from grpc_tools import protoc  # test/dev dependency only

    include = str(Path(protoc.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{include}",
                f"-Ickptd/proto={PROTO_FILE.parent}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                str(PROTO_FILE),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} on {PROTO_FILE}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            dst = out_dir / name
            shutil.copyfile(Path(tmp) / "ckptd" / "proto" / name, dst)
            written.append(dst)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR
    for path in generate(target):
        print(f"wrote {path}")
