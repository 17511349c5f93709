"""The checked-in stubs are exactly what the .proto generates."""

from __future__ import annotations

from pathlib import Path

from ckptd.proto import generate


def test_checked_in_stubs_match_the_proto(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    for name in generate.GENERATED:
        fresh = (tmp_path / name).read_text()
        checked_in = (generate.PROTO_DIR / name).read_text()
        assert fresh == checked_in, f"proto/{name} is stale: run `make proto` and commit the result"
