"""What a reader keeps between reads, owned by the caller that opens it: a DecodeCache holds the decoded moments and
new parameters a later step's decode reads again (the most recently used, by device), one checkpoint directory's
index of tensor names to shards, and the tensors a GPU decoded otherwise than their check. decoding() opens one for
a block (the judge of a case, a stage reading a case's steps); a decode outside any block keeps what it decodes for
that one read alone."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Self

import torch

from qualify.errors import EvidenceError

DECODED_BYTES = 256 << 20
"""How many bytes of decoded moments and new parameters a DecodeCache holds in host memory (the most recently used)."""
DECODED_GPU_SHARE = 0.1
"""The share of a GPU's memory the decoded tensors a DecodeCache holds there may take: a step's moments and new
parameters, which the next step's decode reads (12 bytes a parameter: about 7 GB at the Qwen3-0.6B shape)."""


def held_bytes(device: torch.device) -> int:
    """How many bytes of decoded tensors a DecodeCache may hold on device."""
    if device.type == "cuda":
        return int(DECODED_GPU_SHARE * torch.cuda.get_device_properties(device).total_memory)
    return DECODED_BYTES


class CheckpointIndex:
    """A checkpoint directory's safetensors shards, by the names of the tensors they hold (read from their headers
    on the first look-up): the start of a first step's coded update is read alone, a real model's parameters never
    held whole for it."""

    def __init__(self, model_dir: Path) -> None:
        self.path = Path(model_dir).resolve()
        self._shards: dict[str, Path] | None = None

    def tensor(self, name: str) -> torch.Tensor | None:
        """The tensor of that name as stored (None when no shard holds it)."""
        from safetensors import safe_open

        shard = self._index().get(name)
        if shard is None:
            return None
        with safe_open(str(shard), framework="pt") as f:
            return f.get_tensor(name)

    def _index(self) -> dict[str, Path]:
        from safetensors import SafetensorError, safe_open

        if self._shards is None:
            shards: dict[str, Path] = {}
            try:
                for shard in sorted(self.path.glob("*.safetensors")):
                    with safe_open(str(shard), framework="pt") as f:
                        shards.update(dict.fromkeys(f.keys(), shard))
            except SafetensorError as exc:
                raise EvidenceError(f"{self.path}: a shard is not readable safetensors: {exc}") from exc
            self._shards = shards
        return self._shards


class DecodeCache:
    """What the coded files read within one owner's block keep between reads: the decoded tensors by file, kind,
    name and device (at most held_bytes(device) a device, the least recently used dropped first), the index of the
    checkpoint directory being read (one at a time), and fell_back: the tensors a GPU decoded otherwise than their
    check, which the CPU then decoded as written (a GPU whose arithmetic is not correctly rounded would show there;
    none has: tests/integration/test_codec_gpu.py). Two caches share nothing; close() (the end of a with block)
    drops the tensors and the index it holds."""

    def __init__(self) -> None:
        self._decoded: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._held: dict[str, int] = {}
        self._checkpoint: CheckpointIndex | None = None
        self.fell_back: list[str] = []

    def cached(self, path: Path, kind: str, name: str, device: torch.device,
               compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """compute(), or a copy of it from the decoded tensors held on that device (a later step's prediction reads
        the step before's moment and new parameter: without them every step would decode all the steps before it
        again)."""
        stat = path.stat()
        key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, kind, name, str(device))
        held = self._decoded.get(key)
        if held is not None:
            self._decoded.move_to_end(key)
            return held.clone()
        value = compute()
        nbytes = value.numel() * value.element_size()
        if nbytes <= held_bytes(device) // 4:
            where = key[-1]
            self._decoded[key] = value.clone()
            self._held[where] = self._held.get(where, 0) + nbytes
            while self._held[where] > held_bytes(device):
                self._drop(next(k for k in self._decoded if k[-1] == where))
        return value

    def held(self, device: torch.device | str | None = None) -> int:
        """Bytes of decoded tensors held now (on device, or everywhere)."""
        if device is None:
            return sum(self._held.values())
        return self._held.get(str(torch.device(device)), 0)

    def release(self, device: torch.device | str | None = None) -> None:
        """Drop the decoded tensors held (on device, or everywhere)."""
        where = None if device is None else str(torch.device(device))
        for key in [k for k in self._decoded if where is None or k[-1] == where]:
            self._drop(key)

    def _drop(self, key: tuple) -> None:
        gone = self._decoded.pop(key)
        self._held[key[-1]] -= gone.numel() * gone.element_size()

    def checkpoint_tensor(self, model_dir: Path, name: str) -> torch.Tensor | None:
        """One tensor of a checkpoint directory's shards, as stored (None when no shard holds that name), through
        the index of the directory being read (a new directory's replaces it)."""
        if self._checkpoint is None or self._checkpoint.path != Path(model_dir).resolve():
            self._checkpoint = CheckpointIndex(model_dir)
        return self._checkpoint.tensor(name)

    def close(self) -> None:
        """Drop what is held: the decoded tensors and the checkpoint index (fell_back stays, for its owner to read)."""
        self.release()
        self._checkpoint = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_OPEN: ContextVar[DecodeCache | None] = ContextVar("qualify_decode_cache", default=None)


@contextmanager
def decoding(cache: DecodeCache | None = None) -> Iterator[DecodeCache]:
    """The block's DecodeCache: every coded file this context reads inside the block keeps what it decodes there.
    A cache made here (none given) is closed when the block ends; a given one is left to its owner. Blocks nest: the
    inner one's cache is read until it ends."""
    owned = cache is None
    cache = DecodeCache() if cache is None else cache
    token = _OPEN.set(cache)
    try:
        yield cache
    finally:
        _OPEN.reset(token)
        if owned:
            cache.close()


def open_cache() -> DecodeCache | None:
    """The DecodeCache of the innermost decoding() block open in this context (None outside any)."""
    return _OPEN.get()


@contextmanager
def joined() -> Iterator[DecodeCache]:
    """The open DecodeCache, or where none is open one for this block alone (a read outside any owner's block: what
    it decodes, the steps before it included, is kept until it returns)."""
    cache = _OPEN.get()
    if cache is not None:
        yield cache
        return
    with decoding() as cache:
        yield cache
