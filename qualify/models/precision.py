"""The precisions a matrix names, as torch dtypes and as the dtype names vLLM and transformers take."""

from __future__ import annotations

from typing import Any

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}
"""Matrix precision -> dtype name ('bf16' -> 'bfloat16')."""


def torch_dtype(precision: str) -> Any:
    """Matrix precision -> torch dtype (torch is imported here, not by whoever only needs the names)."""
    import torch

    return getattr(torch, DTYPE_NAMES[precision])
