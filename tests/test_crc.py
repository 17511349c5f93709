"""crc32c combination matches computing over the concatenation."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest

from ckptd.core import checksum as crc


@pytest.mark.parametrize(
    "lengths", [[0, 5], [1, 1], [7, 0, 3], [4096, 1 << 20, 12345], [3, 1 << 22]]
)
def test_combine_equals_crc_of_concatenation(lengths: list[int]) -> None:
    rng = np.random.default_rng(sum(lengths))
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lengths]
    whole = google_crc32c.value(b"".join(pieces))
    assert crc.combine_all([(google_crc32c.value(p), len(p)) for p in pieces]) == whole
    assert (
        crc.combine(
            google_crc32c.value(pieces[0]),
            google_crc32c.value(b"".join(pieces[1:])),
            sum(lengths[1:]),
        )
        == whole
    )


def test_base64_round_trip_matches_store_format() -> None:
    c = google_crc32c.value(b"hello world")
    assert crc.from_base64(crc.to_base64(c)) == c
    assert crc.to_base64(0xC99465AA) == "yZRlqg=="  # crc32c("hello world"), as GCS shows it


@pytest.mark.parametrize(
    "ranges",
    [
        [(0, 10), (64, 5 * 2**20), (5 * 2**20 + 64, 100)],  # large shards are combined
        [(4096, 3 * 2**20), (0, 100), (8 * 2**20, 2 * 2**20)],  # unsorted, with gaps
        [],
    ],
)
def test_file_and_shard_crcs_in_one_pass(ranges: list[tuple[int, int]]) -> None:
    from ckptd.core.checksum import of_file_and_shards as crc32c_file_and_shards

    data = np.random.default_rng(0).integers(0, 256, 12 * 2**20, dtype=np.uint8)
    length = max([o + n for o, n in ranges] + [123]) + 7  # a tail after the last shard
    whole, shards = crc32c_file_and_shards(b"h" * 4096, memoryview(data), length, ranges)
    assert whole == google_crc32c.value(b"h" * 4096 + data[:length].tobytes())
    assert shards == [google_crc32c.value(data[o : o + n].tobytes()) for o, n in ranges]
