"""Whether an engine pads its vocabulary, found by the harness itself rather than taken from the engine.

An engine may shard vocab-sized parameters (the embedding, the output projection) over TP ranks with rows
beyond the real vocabulary (Megatron pads to a multiple of make_vocab_size_divisible_by x TP). Those rows
must be untouched by training, which the engine's padded_rows() lets the harness check; an engine that pads
and reports nothing would otherwise pass unseen. So before the first step the harness looks at every tensor
the engine holds on its rank (its modules' parameters and dicts of tensors, the local shard of a DTensor)
and recognizes a vocabulary shard by its values: a 2-D tensor whose real rows equal, bit for bit, the rows
[rank x rows, ...) of a vocab-sized checkpoint tensor. Rows it holds beyond the vocabulary are padding.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch


def memory_key(t: torch.Tensor) -> tuple:
    """Where a tensor's elements live: its storage, offset, shape, strides, dtype and device. Two views of one
    parameter (a DTensor's to_local(), a tied weight seen under two names) share it; two distinct tensors never do
    while both are alive. Never id() of a view: to_local() makes a new temporary on every call, and the id of a
    freed temporary is reused by the next one, so counting by id counts a shard 0, 1 or several times."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
            str(t.device))


def held_key(held: torch.Tensor, local: torch.Tensor) -> tuple:
    """memory_key of the local tensor; for one without memory (meta, empty: address 0) the object the engine holds,
    which lives as long as the engine does."""
    key = memory_key(local)
    return key if key[0] != 0 else ("object", id(held))


def held_tensors(engine: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(where, local tensor) for every parameter of the engine's modules and every tensor of its dicts, once each
    (once per memory_key: the same elements reached twice are one tensor), in a fixed order."""
    seen: set[tuple] = set()
    for attr, obj in sorted(vars(engine).items()):
        if isinstance(obj, torch.nn.Module):
            items = obj.named_parameters()
        elif isinstance(obj, dict):
            items = ((str(k), v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))
                     if isinstance(v, torch.Tensor))
        else:
            continue
        for name, t in items:
            local = t.to_local() if hasattr(t, "to_local") else t
            key = held_key(t, local)
            if key in seen:
                continue
            seen.add(key)
            yield f"{attr}.{name}", local.detach()


def padding_found(engine: Any, checkpoint: Mapping[str, torch.Tensor], vocab_size: int, tp: int,
                  rank: int) -> dict[str, int]:
    """{where: rows beyond the vocabulary} of every vocabulary shard this rank holds with padding (see the module)."""
    vocab_tensors = [t for t in checkpoint.values() if t.dim() == 2 and t.shape[0] == vocab_size]
    found = {}
    for where, t in held_tensors(engine):
        rows = t.shape[0] if t.dim() == 2 else 0
        if rows == 0 or rows * tp <= vocab_size:
            continue
        start = rank * rows
        real = max(0, min(rows, vocab_size - start))
        if real == 0:  # no real row to recognize the shard by
            continue
        host = t.float().cpu()
        for full in vocab_tensors:
            if full.shape[1] == t.shape[1] and torch.equal(host[:real], full[start:start + real].float()):
                if rows > real:
                    found[where] = rows - real
                break
    return found


def exposed_rows(padded: Mapping[str, torch.Tensor]) -> int:
    """How many padding rows the engine's padded_rows() reports on this rank."""
    return sum(int(t.shape[0]) for t in padded.values())
