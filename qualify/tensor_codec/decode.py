"""Lossless coding of a run's gradients, updates and moments: evidence that grows with the model, not 16 bytes a
parameter a step (issue 29).

A case keeps, per step, its gradients, its updates (new - start parameter) and AdamW's two moments, all fp32: 16 bytes
a parameter. Most of those bits are implied by the others: a bf16 engine's gradients are bf16 values, the moments are
AdamW's function of the clipped gradients, the new parameters AdamW's step of the moments. A coded file keeps, for such
a tensor, only what the implication does not give, and reads back the same fp32 bits:

    bf16    the tensor's values are all bf16 values: kept in bf16 (2 bytes), widened on read
    moment  AdamW's moment: the difference of its fp32 bit pattern from a prediction made of this step's gradient
            (grads.safetensors beside it), the clip coefficient of its reported norm and the previous step's moment
    param   an update u = new - start: the new parameter's bit pattern as a difference from AdamW's step of this step's
            moments from the start, the start being the initial parameter (the run's model directory) or the previous
            step's new parameter; u is read back as the fp32 difference new - start, the operation the case made

A difference of bit patterns is an integer, zero where the prediction is exact; it is kept in whichever form is
smallest: nothing (all zero), dense in 8 or 16 bits with the elements that do not fit listed apart, a sparse list, or
all 32 bits. The predictions are fp32 elementwise arithmetic on the CPU, one IEEE operation at a time (correctly
rounded on every CPU), so any machine reads back the same bits; a CRC32 of each predicted tensor's bytes is checked on
read, so a changed start or gradient is an error, never a wrong number. An engine whose optimizer is not AdamW, or
whose moments are not fp32, loses nothing: the difference is then large and kept in 32 bits.

The file's metadata key CODEC_KEY (JSON) lists the logical tensors in order with their shapes and how each is kept;
a file without it is a plain safetensors file (every file written before this module, and every group not coded).
"""

from __future__ import annotations

import functools
import json
import math
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qualify.errors import EvidenceError

CODEC_KEY = "qualify.codec"
FORMAT = 2
READS = (2,)
"""The predictions' arithmetic: a file is read only by the code that predicts as its writer did (1: torch's square
root, which is not correctly rounded; never in a stopped commit)."""
PART = "#"
"""Separator of a coded tensor's stored parts (name#r, name#i, name#v): no parameter name holds it."""


def f32(x: float) -> np.float32:
    return np.float32(x)


def _hex(x: np.float32) -> str:
    return float(x).hex()


def _unhex(s: str) -> np.float32:
    return np.float32(float.fromhex(s))


CRC_CHUNK = 64 << 20
"""Bytes per piece of a large tensor's CRC32: the pieces are summed up in threads (zlib lets go of the GIL), a GPU
tensor's each copied to the host by the thread that sums it, and joined with crc32_combine."""


CRC_SPENT = {"seconds": 0.0, "bytes": 0}
"""What crc() has summed in this process, and in how long (information for the stages' logs, not evidence)."""


def crc(a: np.ndarray | torch.Tensor) -> int:
    """CRC32 of an array's bytes (zlib.crc32 of them, whatever the array's device)."""
    started = time.monotonic()
    if isinstance(a, torch.Tensor) and a.device.type != "cpu":
        flat = a.detach().contiguous().reshape(-1).view(torch.uint8)
        out = _crc_pieces(flat.numel(), lambda lo, hi: _host_piece(flat[lo:hi]))
    else:
        if isinstance(a, torch.Tensor):
            a = a.detach().contiguous().numpy()
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        out = _crc_pieces(flat.size, lambda lo, hi: flat[lo:hi])
    CRC_SPENT["seconds"] += time.monotonic() - started
    CRC_SPENT["bytes"] += int(flat.numel() if isinstance(flat, torch.Tensor) else flat.size)
    return out


def _crc_pieces(n: int, piece: Callable[[int, int], np.ndarray]) -> int:
    if n <= CRC_CHUNK:
        return zlib.crc32(piece(0, n).data)
    bounds = [(lo, min(n, lo + CRC_CHUNK)) for lo in range(0, n, CRC_CHUNK)]
    crcs = list(_crc_pool().map(lambda b: zlib.crc32(piece(*b).data), bounds))
    out = crcs[0]
    for c, (lo, hi) in zip(crcs[1:], bounds[1:]):
        out = crc32_combine(out, c, hi - lo)
    return out


_POOL: list[Any] = []
_PINNED = __import__("threading").local()


def _crc_pool() -> Any:
    if not _POOL:
        import os
        from concurrent.futures import ThreadPoolExecutor

        _POOL.append(ThreadPoolExecutor(max(1, min(8, len(os.sched_getaffinity(0)))), thread_name_prefix="crc"))
    return _POOL[0]


def _host_piece(t: torch.Tensor) -> np.ndarray:
    """A GPU piece's bytes in this thread's pinned host buffer (reused: pinning memory is slow)."""
    buf = getattr(_PINNED, "buf", None)
    if buf is None or buf.numel() < t.numel():
        buf = _PINNED.buf = torch.empty(max(CRC_CHUNK, t.numel()), dtype=torch.uint8, pin_memory=True)
    host = buf[:t.numel()]
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


# ---------------------------------------------------------------------------------------------------- the residual

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


# ------------------------------------------------------------------------------------------------ the predictions

@dataclass(frozen=True)
class Adam:
    """What the predictions take of the optimizer (from the case's spec), as the fp32 scalars the arithmetic uses."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    max_grad_norm: float | None

    @classmethod
    def of(cls, optimizer: Any) -> Adam:
        get = (lambda k: optimizer.get(k)) if isinstance(optimizer, Mapping) else (lambda k: getattr(optimizer, k))
        b1, b2 = get("betas")
        return cls(float(get("lr")), (float(b1), float(b2)), float(get("eps")), float(get("weight_decay")),
                   None if get("max_grad_norm") is None else float(get("max_grad_norm")))

    def clip(self, norm: float) -> np.float32:
        """The clip coefficient of a reported norm, min(1, max_norm / (norm + 1e-6)) in fp32 as torch's
        clip_grad_norm_ computes it (the predictions' only use of it)."""
        if not self.max_grad_norm or not math.isfinite(norm):
            return f32(1.0)
        with np.errstate(all="ignore"):
            return min(f32(1.0), f32(self.max_grad_norm) / (f32(norm) + f32(1e-6)))


def fma(a: np.float32 | torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a x b + c rounded once to fp32 (as a fused multiply-add), through float64: the product of two fp32 values is
    exact there, the sum rounds twice (a different last bit about once in 2^29 elements: a residual, never an error)."""
    a64 = float(a) if isinstance(a, np.floating) else a.double()
    return (b.double() * a64 + c.double()).float()


def predict_moment(kind: str, g: torch.Tensor, prev: torch.Tensor | None, beta: np.float32, one_minus: np.float32,
                   clip: np.float32) -> torch.Tensor:
    """AdamW's moment of the clipped gradient c g in torch's form: lerp(m, c g, 1 - beta) (m + (1 - beta)(c g - m),
    fused), or fma((1 - beta) c g, c g, beta v) (1 - beta: the fp32 of the double difference, as an optimizer takes
    its scalars). CPU tensors, fp32 and float64 elementwise operations, each correctly rounded."""
    cg = g * _scalar(clip)
    if prev is None:  # the first step, from zero: one fp32 product (the fused forms' value but for the sign of a 0)
        return cg * _scalar(one_minus) if kind == "exp_avg" else (cg * _scalar(one_minus)) * cg
    if kind == "exp_avg":
        return fma(one_minus, cg - prev, prev)
    return fma(cg * _scalar(one_minus), cg, prev * _scalar(beta))


def predict_param(p: torch.Tensor, m: torch.Tensor | None, v: torch.Tensor | None, adam_step: int,
                  adam: Adam) -> torch.Tensor:
    """AdamW's new parameter in torch's form, fp32: p (1 - lr wd) - ((lr / bc1) m) / (sqrt(v) / sqrt(bc2) + eps), the
    division by sqrt(bc2) a product with its fp32 reciprocal (as torch takes a scalar divisor). CPU tensors; only
    multiplications, additions, subtractions, tensor divisions and numpy's square root: each correctly rounded."""
    b1, b2 = adam.betas
    decayed = p * _scalar(f32(1 - adam.lr * adam.weight_decay))
    if m is None or v is None:
        return decayed
    size, bc2 = f32(adam.lr / (1 - b1 ** adam_step)), f32(math.sqrt(1 - b2 ** adam_step))
    # torch divides by a scalar as a product with its fp32 reciprocal: written so here, never left to torch's choice;
    # the square root is numpy's (the CPU's instruction, correctly rounded): torch 2.13's CPU sqrt is not (11,064 of
    # 65,536 fp32 roots a bit off here), so it could differ between machines
    root = _sqrt(v)
    denom = root * _scalar(f32(1.0) / bc2) + _scalar(f32(adam.eps))
    return decayed - (m * _scalar(size)) / denom


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root: numpy's on the CPU (the instruction; torch 2.13's CPU sqrt is not correctly
    rounded), CUDA's own on a GPU (IEEE-rounded sqrt, as torch is built without fast math): the same bits, which
    tests/gpu/test_codec_gpu.py measures against numpy for every fp32 value."""
    if v.device.type == "cpu":
        return torch.from_numpy(np.sqrt(v.contiguous().numpy()))
    return torch.sqrt(v)


def _scalar(x: np.float32) -> torch.Tensor:
    """An fp32 scalar as a 0-d fp32 tensor: the arithmetic stays fp32 whatever the operand (a Python float would be
    rounded to the tensor's dtype too, but a tensor says so)."""
    return torch.tensor(float(x), dtype=torch.float32)


# -------------------------------------------------------------------------------------------------------- writing

@dataclass
class StepCoding:
    """What a step's coding needs beyond its own tensors: the optimizer, which step it is, the moments of the step
    before (logical, None at the first), the start parameters and the new ones (fp32), and where a reader finds the
    start: model_dir (the first step's, from the step's directory) or the step before's updates."""

    adam: Adam
    step: int
    prev_moments: Mapping[str, torch.Tensor] | None = None
    start: Mapping[str, torch.Tensor] | None = None
    new: Mapping[str, torch.Tensor] | None = None
    model_dir: Path | None = None
    startable: frozenset[str] | None = None
    """Past the first step, the updates whose new parameter the step before coded (a reader's start); None: all."""
    device: torch.device | str | None = None
    """Where the predictions are made (None: the CPU). A GPU makes the same bits (every operation correctly rounded:
    tests/integration/test_codec_gpu.py) where the tensors already are, and only the stored parts come back."""


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu()


def _device(coding: StepCoding) -> torch.device:
    return torch.device("cpu") if coding.device is None else torch.device(coding.device)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t flat-contiguous on device (a copy only where it lies elsewhere)."""
    return t.detach().to(device).contiguous()


def _bf16_exact(t: torch.Tensor) -> bool:
    if t.dtype != torch.float32 or not t.numel():
        return False
    return bool(torch.equal(t.bfloat16().float().view(torch.int32), t.view(torch.int32)))


def _logical(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any] | None:
    """The group's names in a plain file's order (safetensors sorts equal dtypes by name) with shapes, or None when the
    group is not all fp32 (then it is not coded)."""
    if not tensors or any(t.dtype != torch.float32 for t in tensors.values()):
        return None
    return {"format": FORMAT, "names": sorted(tensors), "shapes": {n: list(t.shape) for n, t in tensors.items()},
            "coded": {}}


def encode_grads(grads: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, str] | None]:
    """A gradient group: every bf16-valued tensor kept in bf16 (a bf16 engine's gradients are)."""
    doc = _logical(grads)
    if doc is None:
        return dict(grads), None
    stored: dict[str, Any] = {}
    for name, t in grads.items():
        t = t.detach().contiguous().cpu()
        if _bf16_exact(t):
            stored[name] = t.bfloat16()
            doc["coded"][name] = {"form": "bf16"}
        else:
            stored[name] = t
    return stored, _meta(doc)


def _meta(doc: dict[str, Any]) -> dict[str, str] | None:
    return {CODEC_KEY: json.dumps(doc, sort_keys=True, separators=(",", ":"))} if doc["coded"] else None


def encode_moments(moments: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], grad_norm: float,
                   coding: StepCoding) -> tuple[dict[str, Any], dict[str, str] | None]:
    """A moments group ('exp_avg/<name>', 'exp_avg_sq/<name>'): each as its difference from AdamW's moment of the
    step's gradient and the step before's moment."""
    doc = _logical(moments)
    if doc is None:
        return dict(moments), None
    clip = coding.adam.clip(grad_norm)
    stored: dict[str, Any] = {}
    for key, t in moments.items():
        kind, _, name = key.partition("/")
        g = grads.get(name)
        prev = None if coding.prev_moments is None else coding.prev_moments.get(key)
        if (kind not in ("exp_avg", "exp_avg_sq") or g is None or g.dtype != torch.float32 or g.shape != t.shape
                or (coding.step and (prev is None or prev.shape != t.shape or prev.dtype != torch.float32))):
            stored[key] = t
            continue
        b = coding.adam.betas[0 if kind == "exp_avg" else 1]
        beta, one_minus = f32(b), f32(1.0 - b)
        device = _device(coding)
        actual = _on(t, device)
        predicted = predict_moment(kind, _on(g, device), None if prev is None else _on(prev, device), beta,
                                   one_minus, clip)
        parts, form = residual_parts(actual.view(torch.int32) - predicted.view(torch.int32), key)
        stored |= parts
        doc["coded"][key] = {"form": "moment", "kind": kind, "grad": name, "beta": _hex(beta),
                             "one_minus": _hex(one_minus), "clip": _hex(clip),
                             "residual": form, "crc": crc(actual)}
    doc["step"] = coding.step
    return stored, _meta(doc)


def encode_updates(updates: Mapping[str, torch.Tensor], moments: Mapping[str, torch.Tensor], coding: StepCoding,
                   step_dir: Path) -> tuple[dict[str, Any], dict[str, str] | None]:
    """An updates group: each update u = new - start kept as its new parameter's difference from AdamW's step of the
    step's moments, where new - start read back is u bit for bit; any other tensor is kept as it is."""
    doc = _logical(updates)
    if doc is None or coding.start is None or coding.new is None or (coding.step == 0 and coding.model_dir is None):
        return dict(updates), None
    stored: dict[str, Any] = {}
    for name, u in updates.items():
        p, new = coding.start.get(name), coding.new.get(name)
        if coding.step == 0:  # a reader's start: the checkpoint's tensor of that name, which must be this one
            stored_start = checkpoint_tensor(coding.model_dir, name)
            unreadable = (stored_start is None or p is None or stored_start.shape != p.shape
                          or not torch.equal(stored_start.float().view(torch.int32), _cpu(p.float()).view(torch.int32)))
        else:
            unreadable = coding.startable is not None and name not in coding.startable
        if p is None or new is None or p.shape != u.shape or new.shape != u.shape or unreadable:
            stored[name] = u
            continue
        device = _device(coding)
        p32, new32, u32 = _on(p.float(), device), _on(new.float(), device), _on(u, device)
        if not torch.equal((new32 - p32).view(torch.int32), u32.view(torch.int32)):  # not new - start as the reader would make it: kept whole
            stored[name] = u
            continue
        m, v = moments.get(f"exp_avg/{name}"), moments.get(f"exp_avg_sq/{name}")
        usable = m is not None and v is not None and m.shape == u.shape and v.shape == u.shape
        predicted = predict_param(p32, _on(m.float(), device) if usable else None,
                                  _on(v.float(), device) if usable else None, coding.step + 1, coding.adam)
        parts, form = residual_parts(new32.view(torch.int32) - predicted.view(torch.int32), name)
        stored |= parts
        doc["coded"][name] = {"form": "param", "moments": usable, "residual": form, "crc": crc(new32)}
    if doc["coded"]:
        doc["step"] = coding.step
        doc["adam"] = {"lr": coding.adam.lr, "betas": list(coding.adam.betas), "eps": coding.adam.eps,
                       "weight_decay": coding.adam.weight_decay}
        doc["start"] = (_relative(coding.model_dir, step_dir) if coding.step == 0
                        else f"../step{coding.step - 1}/updates.safetensors")
    return stored, _meta(doc)


def param_coded(metadata: Mapping[str, str] | None) -> frozenset[str]:
    """The updates an encode_updates metadata coded by their new parameter (the next step's StepCoding.startable)."""
    doc = parse(metadata)
    return frozenset(n for n, e in (doc or {}).get("coded", {}).items() if e["form"] == "param")


def _relative(target: Path, start: Path) -> str:
    import os

    return os.path.relpath(Path(target).resolve(), Path(start).resolve())


# -------------------------------------------------------------------------------------------------------- reading

class CodedFile:
    """The logical view of a coded file: its names in order, shapes, and each tensor decoded on access, on the CPU or
    on a GPU (the same bits: every prediction's operation is correctly rounded on either; the check of each decoded
    tensor makes any difference an error). read(part) reads a stored part (None when absent); open_file(path) opens
    a sibling file a prediction needs, as the caller reads files (qualify.store.TensorFile: a coded sibling decoded
    in turn, its .tensor(name, device) on a device)."""

    def __init__(self, path: Path, doc: dict[str, Any], read: Callable[[str], torch.Tensor | None],
                 open_file: Callable[[Path], Any]) -> None:
        if doc.get("format") not in READS:
            raise EvidenceError(f"{path}: coded with format {doc.get('format')!r}; this qualify reads formats "
                                f"{', '.join(map(str, READS))}")
        self.path, self.doc, self._read, self._open = Path(path), doc, read, open_file
        self.names: list[str] = list(doc["names"])
        self.shapes = {n: tuple(s) for n, s in doc["shapes"].items()}

    def is_coded(self, name: str) -> bool:
        return name in self.doc["coded"]

    def decode(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """The logical fp32 tensor, made on device (default the CPU)."""
        device = torch.device("cpu") if device is None else torch.device(device)
        entry = self.doc["coded"][name]
        shape = self.shapes[name]
        if entry["form"] == "bf16":
            return self._read(name).to(device).float()
        if entry["form"] == "moment":
            out = self._cached("moment", name, device, lambda: self._moment(name, entry, device))
        elif entry["form"] == "param":
            out = self.new_param(name, device) - self._start(name, device)
        else:
            raise EvidenceError(f"{self.path}: tensor {name} is coded as {entry['form']!r}, which this qualify does "
                                "not read")
        return out.reshape(shape)

    def _check(self, name: str, entry: dict[str, Any], value: torch.Tensor, what: str) -> torch.Tensor:
        if crc(value) != entry["crc"]:
            raise EvidenceError(f"{self.path}: {name} does not decode to what was written (CRC32 differs): {what} is not "
                                "what the case had")
        return value

    def _cached(self, kind: str, name: str, device: torch.device,
                compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """compute(), or a copy of it from the decoded tensors held on that device (a later step's prediction reads
        the step before's moment and new parameter: without them every step would decode all the steps before it
        again)."""
        stat = self.path.stat()
        key = (str(self.path.resolve()), stat.st_mtime_ns, stat.st_size, kind, name, str(device))
        held = _DECODED.get(key)
        if held is not None:
            _DECODED.move_to_end(key)
            return held.clone()
        value = compute()
        nbytes = value.numel() * value.element_size()
        if nbytes <= held_bytes(device) // 4:
            _DECODED[key] = value.clone()
            _HELD[key[-1]] = _HELD.get(key[-1], 0) + nbytes
            while _HELD[key[-1]] > held_bytes(device):
                oldest = next(k for k in _DECODED if k[-1] == key[-1])
                gone = _DECODED.pop(oldest)
                _HELD[key[-1]] -= gone.numel() * gone.element_size()
        return value

    def _moment(self, key: str, entry: dict[str, Any], device: torch.device) -> torch.Tensor:
        r = residual_from(self._read, key, entry["residual"], math.prod(self.shapes[key]), device)
        g = self._open(self.path.parent / "grads.safetensors").tensor(entry["grad"], device).reshape(-1)
        prev = None
        if self.doc.get("step", 0):
            prev = self._open(self.path.parent.parent / f"step{self.doc['step'] - 1}" / self.path.name)
            prev = prev.tensor(key, device).reshape(-1)
        predicted = predict_moment(entry["kind"], g, prev, _unhex(entry["beta"]), _unhex(entry["one_minus"]),
                                   _unhex(entry["clip"]))
        value = (predicted.view(torch.int32) + r).view(torch.float32)
        if device.type != "cpu" and crc(value) != entry["crc"]:  # made again where numpy's root is the reference
            return _fell_back(key, self._moment(key, entry, torch.device("cpu")), device)
        return self._check(key, entry, value, "its gradient or the step before's moment")

    def new_param(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """The new parameter of a 'param'-coded update (flat fp32), made on device (default the CPU)."""
        device = torch.device("cpu") if device is None else torch.device(device)
        return self._cached("new", name, device, lambda: self._new_param(name, device))

    def _new_param(self, name: str, device: torch.device) -> torch.Tensor:
        entry = self.doc["coded"][name]
        r = residual_from(self._read, name, entry["residual"], math.prod(self.shapes[name]), device)
        m = v = None
        if entry["moments"]:
            moments = self._open(self.path.parent / "moments.safetensors")
            m, v = (moments.tensor(f"{k}/{name}", device).reshape(-1) for k in ("exp_avg", "exp_avg_sq"))
        a = self.doc["adam"]
        adam = Adam(a["lr"], tuple(a["betas"]), a["eps"], a["weight_decay"], None)
        predicted = predict_param(self._start(name, device), m, v, self.doc["step"] + 1, adam)
        value = (predicted.view(torch.int32) + r).view(torch.float32)
        if device.type != "cpu" and crc(value) != entry["crc"]:
            return _fell_back(name, self._new_param(name, torch.device("cpu")), device)
        return self._check(name, entry, value, f"the start it is decoded from ({self.doc['start']})")

    def _start(self, name: str, device: torch.device) -> torch.Tensor:
        where = (self.path.parent / self.doc["start"]).resolve()
        if self.doc["step"] == 0:
            if not where.is_dir():
                raise EvidenceError(f"{self.path}: the start parameters of its coded updates are in {where}, which does "
                                    "not exist (a case's evidence is read within its run directory)")
            start = checkpoint_tensor(where, name)
            if start is None:
                raise EvidenceError(f"{self.path}: {where} has no tensor {name}, which its coded update starts from")
            return start.to(device).float().reshape(-1)
        coded = self._open(where).coded
        if coded is not None and coded.is_coded(name) and coded.doc["coded"][name]["form"] == "param":
            return coded.new_param(name, device)
        raise EvidenceError(f"{self.path}: {name}'s start, the step before's new parameter, is not kept in {where}")


FELL_BACK: list[str] = []
"""Tensors a GPU decoded otherwise than its check and the CPU then decoded as written (a GPU whose arithmetic is not
correctly rounded would show here; none has: tests/integration/test_codec_gpu.py)."""


def _fell_back(name: str, value: torch.Tensor, device: torch.device) -> torch.Tensor:
    import warnings

    if not FELL_BACK:
        warnings.warn(f"{name}: decoded on {device} otherwise than written; decoded on the CPU instead (a GPU "
                      "prediction that is not correctly rounded)", stacklevel=3)
    FELL_BACK.append(name)
    return value.to(device)


DECODED_BYTES = 256 << 20
"""How many bytes of decoded moments and new parameters a process holds in host memory (the most recently used)."""
DECODED_GPU_SHARE = 0.1
"""The share of a GPU's memory the decoded tensors held there may take: a step's moments and new parameters, which the
next step's decode reads (12 bytes a parameter: about 7 GB at the Qwen3-0.6B shape)."""
_DECODED: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_HELD: dict[str, int] = {}


def held_bytes(device: torch.device) -> int:
    """How many bytes of decoded tensors may be held on device."""
    if device.type == "cuda":
        return int(DECODED_GPU_SHARE * torch.cuda.get_device_properties(device).total_memory)
    return DECODED_BYTES


def release(device: torch.device | str | None = None) -> None:
    """Drop the decoded tensors held (on device, or everywhere)."""
    where = None if device is None else str(torch.device(device))
    for key in [k for k in _DECODED if where is None or k[-1] == where]:
        gone = _DECODED.pop(key)
        _HELD[key[-1]] -= gone.numel() * gone.element_size()


_INDEX: dict[str, dict[str, Path]] = {}


def checkpoint_tensor(model_dir: Path, name: str) -> torch.Tensor | None:
    """One tensor of a checkpoint directory's safetensors shards, as stored (None when no shard holds that name): the
    start of a first step's coded update, read alone (a real model's parameters are never held whole for it)."""
    from safetensors import SafetensorError, safe_open

    key = str(Path(model_dir).resolve())
    if key not in _INDEX:
        index: dict[str, Path] = {}
        try:
            for shard in sorted(Path(key).glob("*.safetensors")):
                with safe_open(str(shard), framework="pt") as f:
                    index.update(dict.fromkeys(f.keys(), shard))
        except SafetensorError as exc:
            raise EvidenceError(f"{key}: a shard is not readable safetensors: {exc}") from exc
        _INDEX.clear()  # the model directory being read: one at a time
        _INDEX[key] = index
    shard = _INDEX[key].get(name)
    if shard is None:
        return None
    with safe_open(str(shard), framework="pt") as f:
        return f.get_tensor(name)


def parse(metadata: Mapping[str, str] | None) -> dict[str, Any] | None:
    """The codec document of a safetensors file's metadata, or None for a plain file."""
    if not metadata or CODEC_KEY not in metadata:
        return None
    try:
        return json.loads(metadata[CODEC_KEY])
    except json.JSONDecodeError as exc:
        raise EvidenceError(f"unreadable {CODEC_KEY} metadata: {exc}") from exc
