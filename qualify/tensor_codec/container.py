"""The coded file's container: the metadata key that marks a coded safetensors file, its format, how a coded
tensor's stored parts are named, and the document kept under that key (JSON)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from qualify.errors import EvidenceError

CODEC_KEY = "qualify.codec"
FORMAT = 2
READS = (2,)
"""The predictions' arithmetic: a file is read only by the code that predicts as its writer did (1: torch's square
root, which is not correctly rounded; never in a stopped commit)."""
PART = "#"
"""Separator of a coded tensor's stored parts (name#r, name#i, name#v): no parameter name holds it."""


def hex_of(x: np.float32) -> str:
    """An fp32 scalar as the document keeps it (exact: Python's hexadecimal float)."""
    return float(x).hex()


def unhex(s: str) -> np.float32:
    return np.float32(float.fromhex(s))


def parse(metadata: Mapping[str, str] | None) -> dict[str, Any] | None:
    """The codec document of a safetensors file's metadata, or None for a plain file."""
    if not metadata or CODEC_KEY not in metadata:
        return None
    try:
        return json.loads(metadata[CODEC_KEY])
    except json.JSONDecodeError as exc:
        raise EvidenceError(f"unreadable {CODEC_KEY} metadata: {exc}") from exc
