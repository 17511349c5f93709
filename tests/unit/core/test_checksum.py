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
    data = np.random.default_rng(0).integers(0, 256, 12 * 2**20, dtype=np.uint8)
    length = max([o + n for o, n in ranges] + [123]) + 7  # a tail after the last shard
    stream = crc.FileCrc(b"h" * 4096, ranges, length)
    stream.feed(data, length)
    whole, shards = stream.result()
    assert whole == google_crc32c.value(b"h" * 4096 + data[:length].tobytes())
    assert shards == [google_crc32c.value(data[o : o + n].tobytes()) for o, n in ranges]


def test_combine_by_tables_matches_the_bitwise_operator_at_any_length() -> None:
    # The byte tables are a faster form of the GF(2) matrices; lengths up to 2**50
    # (no buffer that long is needed: the matrices themselves are the reference).
    def bitwise(a: int, b: int, n: int) -> int:
        bit = 0
        while n:
            if n & 1:
                a = crc._times(crc._zeros_operator(bit), a)
            n >>= 1
            bit += 1
        return a ^ b

    rng = np.random.default_rng(5)
    for _ in range(500):
        a, b = (int(x) for x in rng.integers(0, 2**32, 2))
        n = int(rng.integers(0, 2 ** int(rng.integers(1, 51))))
        assert crc.combine(a, b, n) == bitwise(a, b, n)


@pytest.mark.parametrize("step", [1, 4093, 2**20, 3 * 2**20 + 5])
def test_file_crc_fed_as_data_lands_equals_one_pass(step: int) -> None:
    # What the saver does: the crc trails the write, fed up to each chunk written.
    data = np.random.default_rng(1).integers(0, 256, 7 * 2**20, dtype=np.uint8)
    ranges = [(0, 0), (0, 100), (128, 20000), (20480, 3 * 2**20), (3 * 2**20 + 20480, 17)]
    length = 3 * 2**20 + 20480 + 17 + 999  # a tail after the last shard
    header = b"h" * 4096
    stream = crc.FileCrc(header, ranges, length)
    for upto in [*range(step, length, step), length, length]:
        stream.feed(data, upto)
    whole, shards = stream.result()
    assert whole == google_crc32c.value(header + data[:length].tobytes())
    assert shards == [google_crc32c.value(data[o : o + n].tobytes()) for o, n in ranges]


def test_file_crc_refuses_overlapping_shards_and_an_unfinished_feed() -> None:
    with pytest.raises(ValueError, match="overlaps"):
        crc.FileCrc(b"", [(0, 100), (50, 100)], 200)
    stream = crc.FileCrc(b"", [(0, 100)], 200)
    stream.feed(np.zeros(200, np.uint8), 150)
    with pytest.raises(ValueError, match="only 150 bytes"):
        stream.result()
