"""qualify.tensor_codec.checksum: CRC32 of a tensor's bytes in pieces, and the CrcMeter a caller opens to count it."""

from __future__ import annotations

import zlib

import numpy as np
import torch

from qualify.tensor_codec import checksum


def test_a_crc_summed_in_pieces_is_zlibs_crc_of_the_whole(monkeypatch):
    """checksum.crc sums a large tensor's bytes in pieces (threads) joined by crc32_combine: the value is
    zlib.crc32 of all the bytes, at piece boundaries that fall anywhere (the negative control: the pieces' CRCs
    XOR-ed without carrying the first through the second's length are not it)."""
    data = np.random.default_rng(3).integers(0, 256, 1_000_003, dtype=np.uint8)
    whole = zlib.crc32(data.data)
    for chunk in (4096, 333_333, 1 << 20):
        monkeypatch.setattr(checksum, "CRC_CHUNK", chunk)
        assert checksum.crc(data) == whole
        assert checksum.crc(torch.from_numpy(data.copy())) == whole
    a, b = data[:1000].tobytes(), data[1000:5000].tobytes()
    assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), 0) == zlib.crc32(a)
    assert zlib.crc32(a) ^ zlib.crc32(b) != zlib.crc32(a + b)


def test_a_meter_counts_what_crc_sums_while_it_is_open_and_nothing_else():
    """A CrcMeter is its caller's: it counts the bytes crc() sums inside its block (an outer meter those of an inner
    one too), nothing before or after, and there is no counter of the whole process to read."""
    data = np.arange(1000, dtype=np.uint8)
    checksum.crc(data)
    with checksum.metering() as outer:
        checksum.crc(data)
        with checksum.metering() as inner:
            checksum.crc(torch.from_numpy(data[:300].copy()))
        checksum.crc(data[:10])
    checksum.crc(data)
    assert (outer.bytes, inner.bytes) == (1310, 300)
    assert outer.seconds >= inner.seconds >= 0.0
    assert not hasattr(checksum, "CRC_SPENT")
