"""A difference of bit patterns (int32, zero where a prediction is exact) kept in its smallest form, and read back."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from qualify.errors import EvidenceError
from qualify.tensor_codec.container import PART


def residual_parts(r: np.ndarray | torch.Tensor, name: str) -> tuple[dict[str, torch.Tensor], str]:
    """An int32 difference kept in its smallest form: (stored parts by name, as CPU tensors; form). r may lie on a GPU:
    only the parts are copied to the host."""
    r = (torch.from_numpy(np.ascontiguousarray(r)) if isinstance(r, np.ndarray) else r).reshape(-1)
    idx = torch.nonzero(r).reshape(-1)
    if not idx.numel():
        return {}, "zero"
    n = r.numel()
    itype = torch.int32 if n < 2 ** 31 else torch.int64
    isize = torch.empty((), dtype=itype).element_size()
    sizes = {"sparse": idx.numel() * (isize + 4), "int32": 4 * n}
    outside = {}
    if sizes["sparse"] > n:  # a dense form may be smaller: which elements each width cannot hold (of the nonzero)
        nonzero = r[idx]
        for form, dt in (("int8", torch.int8), ("int16", torch.int16)):
            info = torch.iinfo(dt)
            out = idx[(nonzero < info.min) | (nonzero > info.max)]
            outside[form] = out
            sizes[form] = n * info.bits // 8 + out.numel() * (isize + 4)
    form = min(sizes, key=lambda f: (sizes[f], f != "int32"))
    if form == "int32":
        return {f"{name}{PART}r": r.cpu().clone()}, form
    if form == "sparse":
        return {f"{name}{PART}i": idx.to(itype).cpu(), f"{name}{PART}v": r[idx].cpu()}, form
    out = outside[form]
    dense = r.clone()
    dense[out] = 0
    parts = {f"{name}{PART}r": dense.to(torch.int8 if form == "int8" else torch.int16).cpu()}
    if out.numel():
        parts |= {f"{name}{PART}i": out.to(itype).cpu(), f"{name}{PART}v": r[out].cpu()}
    return parts, form


def residual_from(read: Callable[[str], torch.Tensor | None], name: str, form: str, numel: int,
                  device: torch.device | None = None) -> torch.Tensor:
    """The int32 difference back from its stored parts (read(part) -> CPU tensor or None), on device (default the
    CPU): only the stored parts are copied there (an int8 form a quarter of the difference's bytes)."""
    device = torch.device("cpu") if device is None else device
    part = (lambda p: None if (t := read(f"{name}{PART}{p}")) is None else t.to(device))
    if form == "zero":
        return torch.zeros(numel, dtype=torch.int32, device=device)
    if form == "sparse":
        r = torch.zeros(numel, dtype=torch.int32, device=device)
        r[part("i").long()] = part("v").to(torch.int32)
        return r
    r = part("r").to(torch.int32)
    if r.numel() != numel:
        raise EvidenceError(f"coded tensor {name}: {r.numel()} stored elements, {numel} expected")
    idx = part("i")
    if idx is not None:
        r[idx.long()] = part("v").to(torch.int32)
    return r

