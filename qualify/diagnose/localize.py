"""Where a candidate first leaves its per-layer bounds: rows in computation order and the first that fails.

Computation order is the order in which an error can arise and then spread: the forward, module by
module ('act/model.layers.0.input_layernorm' ... 'act/model.layers.<L-1>', 'act/model.norm'), then the
backward, which runs from the head down to the embedding ('grads/head', 'grads/model.layers.<L-1>' ...
'grads/model.layers.0', 'grads/model.embed_tokens'). A fault in layer L leaves every earlier row within
bound, so the first failing row names L and the module; a fault only in the backward (a gradient
reduction, say) leaves the whole forward within bound and is named by its gradient group.
Pure functions on numbers: the measurements come from qualify.bounds.layers.layer_metrics.
"""

from __future__ import annotations

import math
from typing import Any

from qualify.bounds.layers import layer_index
from qualify.models.hooks import FINAL_NORM, PARTS
from qualify.verdict import Row

MISSING = "missing in candidate"
LAYERS = "layers"
"""The comparison of a layer row: the candidate's layer against the reference's, held to the frozen layer bound."""
LAYER_RULE = "value <= the frozen layer bound of its (layer key, metric) (qualify.bounds.layers)"


class LayerRow(Row):
    """One (layer key, metric) judged against its frozen layer bound: a verdict Row whose tensor is the layer key
    ('act/<module>' or 'grads/<group>'), viewed by phase and layer. A value that is not a number is infinitely far
    past its bound (ratio inf), so it is the worst of its key."""

    __slots__ = ()

    def __init__(self, key: str, metric: str, value: float, bound: float, passed: bool, note: str = "") -> None:
        Row.__init__(self, "", "", LAYERS, key, metric, value, bound, passed, note, rule=LAYER_RULE)

    @property
    def key(self) -> str:
        return self.tensor

    @property
    def phase(self) -> str:
        return "forward" if self.key.startswith("act/") else "backward"

    @property
    def layer(self) -> str:
        """'0', '1', ... for a decoder layer, else 'final norm', 'head' or 'embedding'."""
        name = self.key.partition("/")[2]
        i = layer_index(name)
        if i is not None:
            return str(i)
        return {FINAL_NORM: "final norm", "head": "head"}.get(name, "embedding")

    @property
    def ratio(self) -> float:
        return math.inf if math.isnan(self.value) else Row.ratio.fget(self)

    def to_json(self) -> dict[str, Any]:
        """The diagnosis's row: key, metric, value, bound, passed, note, phase, layer and ratio (non-finite numbers
        as strings, as in a verdict row)."""
        d = Row.to_json(self)
        return {"key": d["tensor"], **{k: d[k] for k in ("metric", "value", "bound", "passed", "note")},
                "phase": self.phase, "layer": self.layer, "ratio": d["ratio"]}


def order_key(key: str) -> tuple[int, int, int]:
    """Sort key of a layer key in computation order (see the module docstring)."""
    group, _, name = key.partition("/")
    if group == "act":
        if name == FINAL_NORM:
            return (0, 1 << 30, 0)
        i = layer_index(name)
        part = name.removeprefix(f"model.layers.{i}").lstrip(".")
        return (0, i, PARTS.index(part) if part in PARTS else len(PARTS))
    if name == "head":
        return (1, 0, 0)
    i = layer_index(name)
    return (1, 1, -i) if i is not None else (1, 2, 0)


def judge_layers(measured: dict[str, dict[str, float]], bounds: dict[str, dict[str, dict[str, Any]]],
                 problems: dict[str, str] | None = None, forward: bool = True) -> list[LayerRow]:
    """Every frozen (key, metric) in computation order: value against bound; a key the candidate lacks fails.

    problems: a note per key that could not be measured (shape mismatch); forward False leaves the
    activations out (an engine without the layer_outputs hook: its gradients are still judged).
    """
    rows = []
    for key in sorted(bounds, key=order_key):
        if not forward and key.startswith("act/"):
            continue
        for metric in sorted(bounds[key]):
            bound = float(bounds[key][metric]["bound"])
            value = measured.get(key, {}).get(metric)
            if value is None:
                rows.append(LayerRow(key, metric, math.inf, bound, False, (problems or {}).get(key, MISSING)))
            else:
                rows.append(LayerRow(key, metric, value, bound, value <= bound))
    return rows


def first_departure(rows: list[LayerRow]) -> LayerRow | None:
    """The worst metric of the first key (in computation order) with a failing row; None when all are within bound."""
    for row in rows:
        if not row.passed:
            same_key = [r for r in rows if r.key == row.key and not r.passed]
            return max(same_key, key=lambda r: r.ratio)
    return None


def by_layer(rows: list[LayerRow]) -> list[dict[str, Any]]:
    """Per layer (computation order of first appearance): the worst value/bound of its forward and backward rows."""
    out: dict[str, dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: _layer_position(r.layer)):
        slot = out.setdefault(row.layer, {"layer": row.layer, "forward": None, "backward": None})
        slot[row.phase] = row.ratio if slot[row.phase] is None else max(slot[row.phase], row.ratio)
    return list(out.values())


def _layer_position(layer: str) -> tuple[int, int]:
    """Layers in model order for plots: embedding, 0 .. L-1, final norm, head."""
    if layer.isdigit():
        return (1, int(layer))
    return {"embedding": (0, 0), "final norm": (2, 0), "head": (3, 0)}[layer]
