"""The value types of a matrix's fields and the checks of single values that every section's validation shares:
finite numbers, lower bounds, distinct lists, seeds and the sizes of a tiny family."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, Literal

Precision = Literal["fp32", "bf16"]
Perturbation = Literal["microbatch_split", "batch_order", "attn_impl", "tp_split", "fused_projections",
                       "optimizer_order", "fused_adam", "fused_norm", "packed", "combined"]
TokenNormalizer = Literal["global", "per_sequence", "constant"]
Topology = Literal["dedicated", "shared"]
LogprobFormula = Literal["full", "processed"]
Algorithm = Literal["ppo", "grpo"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3", "k3_ratio"]
ClipFrac = Literal["loss_weighted", "token_mean"]
StdEstimator = Literal["population", "unbiased"]
Packing = Literal["padded", "packed"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16")
METRIC_KINDS = ("logprob", "value", "loss", "grad", "grad_norm", "update", "target", "relative")
MAX_SEED = 2**63 - 1

MAX_TINY_SIZE = 1 << 20
"""The largest any dimension of a tiny family may be (a width, a count, the vocabulary): beyond it no machine holds the
model, and torch fails on it (qualify.memory.tiny_family_problem then bounds the whole family by this machine's
memory)."""


def finite(obj: Any) -> None:
    """Every float field of a config dataclass (alone, in a tuple or a dict) is finite: YAML reads .nan and .inf."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, tuple) else None
        for key, v in items if items is not None else [(None, value)]:
            if isinstance(v, float) and not math.isfinite(v):
                where = f.name if key is None else f"{f.name}[{key}]" if isinstance(key, int) else f"{f.name}.{key}"
                raise ValueError(f"{where} must be a finite number, got {v}")


def at_least(obj: Any, low: float, *names: str) -> None:
    """Each named numeric field is >= low."""
    for name in names:
        value = getattr(obj, name)
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def positive(obj: Any, *names: str) -> None:
    """Each named float field is > 0."""
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def distinct(name: str, values: tuple, *, nonempty: bool = True) -> None:
    """A list field names each value once (and names at least one when nonempty)."""
    if nonempty and not values:
        raise ValueError(f"{name} must list at least one value")
    repeated = sorted({v for v in values if values.count(v) > 1}, key=str)
    if repeated:
        raise ValueError(f"{name} lists {repeated} more than once (each value at most once)")


def seed_in_range(name: str, value: int) -> None:
    if not 0 <= value <= MAX_SEED:
        raise ValueError(f"{name} must be in [0, 2^63 - 1], got {value}")


def at_most_tiny(obj: Any, *names: str) -> None:
    """Each named size is <= MAX_TINY_SIZE."""
    for name in names:
        value = getattr(obj, name)
        if value > MAX_TINY_SIZE:
            raise ValueError(f"{name} {value} is over {MAX_TINY_SIZE}: a tiny family's sizes are bounded (its models "
                             "are made in this machine's memory)")
