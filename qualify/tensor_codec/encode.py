"""Writing: a step's gradients, moments and updates coded by what AdamW's implication does not give."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qualify.tensor_codec.cache import CheckpointIndex
from qualify.tensor_codec.checksum import crc
from qualify.tensor_codec.container import CODEC_KEY, FORMAT, hex_of, parse
from qualify.tensor_codec.predict import Adam, f32, predict_moment, predict_param
from qualify.tensor_codec.residual import residual_parts


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
        doc["coded"][key] = {"form": "moment", "kind": kind, "grad": name, "beta": hex_of(beta),
                             "one_minus": hex_of(one_minus), "clip": hex_of(clip),
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
    checkpoint = CheckpointIndex(coding.model_dir) if coding.step == 0 else None
    for name, u in updates.items():
        p, new = coding.start.get(name), coding.new.get(name)
        if checkpoint is not None:  # a reader's start: the checkpoint's tensor of that name, which must be this one
            stored_start = checkpoint.tensor(name)
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

