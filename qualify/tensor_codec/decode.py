"""Reading: a coded file's logical fp32 tensors, decoded on access on the CPU or a GPU and checked by CRC32, what a
read decodes kept in the open DecodeCache (qualify.tensor_codec.cache.decoding)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qualify.errors import EvidenceError
from qualify.tensor_codec.cache import DecodeCache, joined
from qualify.tensor_codec.checksum import crc
from qualify.tensor_codec.container import READS, unhex
from qualify.tensor_codec.predict import Adam, predict_moment, predict_param
from qualify.tensor_codec.residual import residual_from


class CodedFile:
    """The logical view of a coded file: its names in order, shapes, and each tensor decoded on access, on the CPU or
    on a GPU (the same bits: every prediction's operation is correctly rounded on either; the check of each decoded
    tensor makes any difference an error). read(part) reads a stored part (None when absent); open_file(path) opens
    a sibling file a prediction needs, as the caller reads files (qualify.store.TensorFile: a coded sibling decoded
    in turn, its .tensor(name, device) on a device). What a decode makes is kept in the DecodeCache of the
    decoding() block open around it (a read outside any block: one of its own, until it returns)."""

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
        if entry["form"] not in ("moment", "param"):
            raise EvidenceError(f"{self.path}: tensor {name} is coded as {entry['form']!r}, which this qualify does "
                                "not read")
        with joined() as cache:
            if entry["form"] == "moment":
                out = cache.cached(self.path, "moment", name, device, lambda: self._moment(name, entry, device, cache))
            else:
                out = self.new_param(name, device) - self._start(name, device, cache)
        return out.reshape(shape)

    def _check(self, name: str, entry: dict[str, Any], value: torch.Tensor, what: str) -> torch.Tensor:
        if crc(value) != entry["crc"]:
            raise EvidenceError(f"{self.path}: {name} does not decode to what was written (CRC32 differs): {what} is not "
                                "what the case had")
        return value

    def _moment(self, key: str, entry: dict[str, Any], device: torch.device, cache: DecodeCache) -> torch.Tensor:
        r = residual_from(self._read, key, entry["residual"], math.prod(self.shapes[key]), device)
        g = self._open(self.path.parent / "grads.safetensors").tensor(entry["grad"], device).reshape(-1)
        prev = None
        if self.doc.get("step", 0):
            prev = self._open(self.path.parent.parent / f"step{self.doc['step'] - 1}" / self.path.name)
            prev = prev.tensor(key, device).reshape(-1)
        predicted = predict_moment(entry["kind"], g, prev, unhex(entry["beta"]), unhex(entry["one_minus"]),
                                   unhex(entry["clip"]))
        value = (predicted.view(torch.int32) + r).view(torch.float32)
        if device.type != "cpu" and crc(value) != entry["crc"]:  # made again where numpy's root is the reference
            return _fell_back(cache, key, self._moment(key, entry, torch.device("cpu"), cache), device)
        return self._check(key, entry, value, "its gradient or the step before's moment")

    def new_param(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """The new parameter of a 'param'-coded update (flat fp32), made on device (default the CPU)."""
        device = torch.device("cpu") if device is None else torch.device(device)
        with joined() as cache:
            return cache.cached(self.path, "new", name, device, lambda: self._new_param(name, device, cache))

    def _new_param(self, name: str, device: torch.device, cache: DecodeCache) -> torch.Tensor:
        entry = self.doc["coded"][name]
        r = residual_from(self._read, name, entry["residual"], math.prod(self.shapes[name]), device)
        m = v = None
        if entry["moments"]:
            moments = self._open(self.path.parent / "moments.safetensors")
            m, v = (moments.tensor(f"{k}/{name}", device).reshape(-1) for k in ("exp_avg", "exp_avg_sq"))
        a = self.doc["adam"]
        adam = Adam(a["lr"], tuple(a["betas"]), a["eps"], a["weight_decay"], None)
        predicted = predict_param(self._start(name, device, cache), m, v, self.doc["step"] + 1, adam)
        value = (predicted.view(torch.int32) + r).view(torch.float32)
        if device.type != "cpu" and crc(value) != entry["crc"]:
            return _fell_back(cache, name, self._new_param(name, torch.device("cpu"), cache), device)
        return self._check(name, entry, value, f"the start it is decoded from ({self.doc['start']})")

    def _start(self, name: str, device: torch.device, cache: DecodeCache) -> torch.Tensor:
        where = (self.path.parent / self.doc["start"]).resolve()
        if self.doc["step"] == 0:
            if not where.is_dir():
                raise EvidenceError(f"{self.path}: the start parameters of its coded updates are in {where}, which does "
                                    "not exist (a case's evidence is read within its run directory)")
            start = cache.checkpoint_tensor(where, name)
            if start is None:
                raise EvidenceError(f"{self.path}: {where} has no tensor {name}, which its coded update starts from")
            return start.to(device).float().reshape(-1)
        coded = self._open(where).coded
        if coded is not None and coded.is_coded(name) and coded.doc["coded"][name]["form"] == "param":
            return coded.new_param(name, device)
        raise EvidenceError(f"{self.path}: {name}'s start, the step before's new parameter, is not kept in {where}")


def _fell_back(cache: DecodeCache, name: str, value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """value (the CPU's decode) on device, noted in cache.fell_back (a warning the first time in that cache)."""
    import warnings

    if not cache.fell_back:
        warnings.warn(f"{name}: decoded on {device} otherwise than written; decoded on the CPU instead (a GPU "
                      "prediction that is not correctly rounded)", stacklevel=3)
    cache.fell_back.append(name)
    return value.to(device)
