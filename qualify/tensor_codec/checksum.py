"""CRC32 of a tensor's bytes, on the CPU or a GPU, large tensors summed in pieces joined with crc32_combine; what it
summed and in how long is counted by the CrcMeter a caller opens (metering())."""

from __future__ import annotations

import functools
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch

CRC_CHUNK = 64 << 20
"""Bytes per piece of a large tensor's CRC32: the pieces are summed up in threads (zlib lets go of the GIL), a GPU
tensor's each copied to the host by the thread that sums it, and joined with crc32_combine."""



@dataclass
class CrcMeter:
    """What crc() summed while this meter was open, and in how long (information for a stage's log, not evidence).
    A caller owns it: metering() opens one for a block of its own."""

    seconds: float = 0.0
    bytes: int = 0


_OPEN_METERS: ContextVar[tuple[CrcMeter, ...]] = ContextVar("qualify_crc_meters", default=())


@contextmanager
def metering() -> Iterator[CrcMeter]:
    """A CrcMeter counting every crc() this context makes until the block ends (meters nest: an outer one counts what
    an inner one does)."""
    meter = CrcMeter()
    token = _OPEN_METERS.set((*_OPEN_METERS.get(), meter))
    try:
        yield meter
    finally:
        _OPEN_METERS.reset(token)


def crc(a: np.ndarray | torch.Tensor) -> int:
    """CRC32 of an array's bytes (zlib.crc32 of them, whatever the array's device), counted by the open meters."""
    started = time.monotonic()
    if isinstance(a, torch.Tensor) and a.device.type != "cpu":
        flat = a.detach().contiguous().reshape(-1).view(torch.uint8)
        out = _crc_pieces(flat.numel(), lambda lo, hi: _host_piece(flat[lo:hi]))
    else:
        if isinstance(a, torch.Tensor):
            a = a.detach().contiguous().numpy()
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        out = _crc_pieces(flat.size, lambda lo, hi: flat[lo:hi])
    meters = _OPEN_METERS.get()
    if meters:
        seconds = time.monotonic() - started
        nbytes = int(flat.numel() if isinstance(flat, torch.Tensor) else flat.size)
        for meter in meters:
            meter.seconds += seconds
            meter.bytes += nbytes
    return out


def _crc_pieces(n: int, piece: Callable[[int, int], np.ndarray]) -> int:
    """CRC32 of n bytes given piece by piece: one piece here, more summed in threads of a pool made for this call
    (a thread costs microseconds, a piece milliseconds) and joined with crc32_combine."""
    if n <= CRC_CHUNK:
        return zlib.crc32(piece(0, n).data)
    import os
    from concurrent.futures import ThreadPoolExecutor

    bounds = [(lo, min(n, lo + CRC_CHUNK)) for lo in range(0, n, CRC_CHUNK)]
    threads = max(1, min(8, len(bounds), len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(threads, thread_name_prefix="crc") as pool:
        crcs = list(pool.map(lambda b: zlib.crc32(piece(*b).data), bounds))
    out = crcs[0]
    for c, (lo, hi) in zip(crcs[1:], bounds[1:]):
        out = crc32_combine(out, c, hi - lo)
    return out


def _host_piece(t: torch.Tensor) -> np.ndarray:
    """A GPU piece's bytes in a pinned host buffer of its own (torch's caching host allocator hands a freed one back
    for the next piece: pinning memory anew is slow)."""
    host = torch.empty(t.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(t)
    return host.numpy()


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, row) for row in mat]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32 of A + B from crc1 = CRC32(A), crc2 = CRC32(B) and B's length in bytes (zlib's crc32_combine:
    crc1 carried through len2 zero bytes, a linear map of its bits, made once per length)."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2


@functools.lru_cache(maxsize=8)
def _zeros_operator(len2: int) -> list[int]:
    """The matrix (one row per bit) carrying a CRC through len2 zero bytes."""
    return [_through_zeros(1 << i, len2) for i in range(32)]


def _through_zeros(crc1: int, len2: int) -> int:
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two
    odd = _gf2_square(even)  # four
    while True:
        even = _gf2_square(odd)  # first pass: one zero byte
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1

