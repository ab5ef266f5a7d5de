"""The numbers behind the HTML report's figures and tables, from the verdict, bounds and reference evidence."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from qualify.bounds.files import dominant_term
from qualify.report import RunDocs
from qualify.report_verify import ROW_KEYS, number
from qualify.verdict import Row

TENSOR_FAMILIES = ("outputs", "grads", "updates", "moments")
TEXT_KEYS = ("case", "role", "comparison", "tensor", "metric")


def readable_row(row: Any) -> bool:
    """A row the page can table and plot: the verdict's fields, text where text is due, a number for value and
    bound (a float, or 'inf'/'nan'), a bool for passed, an int or nothing for step. A forged verdict may hold
    anything else."""
    if not isinstance(row, dict) or any(k not in row for k in ROW_KEYS):
        return False
    if not all(isinstance(row[k], str) for k in TEXT_KEYS) or not isinstance(row["passed"], bool):
        return False
    step = row.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        return False
    try:
        number(row["value"]), number(row["bound"])
    except (TypeError, ValueError):
        return False
    return True


def readable_rows(rows: list[Any]) -> list[Row]:
    """The readable rows of a verdict (readable_row) as typed rows."""
    return [Row.from_json(r) for r in rows if readable_row(r)]


def ratio_of(row: Row) -> float:
    """value/bound of a readable row, as qualify.verdict.Row.ratio gives it: at a zero bound 0 for a zero value and
    inf for any other; computed, not read, so a row's recorded 'ratio' never has to be a number."""
    value, bound = number(row.value), number(row.bound)
    if bound > 0:
        return value / bound
    return 0.0 if value == 0 else math.inf


def _ratio(value: Any) -> float | None:
    """A case summary's worst value/bound; None (a grey cell) when absent or not a number (a forged verdict's)."""
    try:
        return number(value)
    except (TypeError, ValueError):
        return None


def heatmap_cells(cases: dict[str, dict[str, Any]]) -> tuple[list[str], list[str], dict]:
    """Rows 'engine role', columns 'precision tpN'; each cell the case's worst value/bound and outcome."""
    named = {n: c for n, c in cases.items() if "engine" in c}
    rows = sorted({f"{c['engine']} {c['role']}" for c in named.values()})
    cols = [f"{p} tp{tp}" for p, tp in sorted({(c["precision"], c["tp"]) for c in named.values()},
                                              key=lambda x: (x[0] != "fp32", x[1]))]
    cells = {(f"{c['engine']} {c['role']}", f"{c['precision']} tp{c['tp']}"):
             (_ratio((c["worst"] or {}).get("ratio")), c["passed"]) for c in named.values()}
    return rows, cols, cells


def family_ratios(rows: list[Row]) -> tuple[list[str], dict[tuple[str, str], float]]:
    """Largest value/bound per (case, tensor family) over rows with a bound."""
    out: dict[tuple[str, str], float] = {}
    for r in rows:
        if r.group in TENSOR_FAMILIES and number(r.bound) > 0:
            key = (r.case, r.group)
            out[key] = max(out.get(key, 0.0), ratio_of(r))
    return [f for f in TENSOR_FAMILIES if any(k[1] == f for k in out)], out


def bound_docs(docs: RunDocs) -> dict[tuple[str, str], dict[str, Any]]:
    """The frozen bound files by (role, family), when frozen."""
    from qualify.bounds.files import read_bound_files

    if docs.acceptance is None:
        return {}
    return read_bound_files(docs.layout.acceptance_dir, docs.acceptance.get("bounds", {}), missing_ok=True)


def set_by(row: Row, bounds: dict[tuple[str, str], dict[str, Any]]) -> str:
    """The bound family and the term of the rule (qualify.bounds.rule.FORMULA) that dominates."""
    if row.family is None:
        return "evidence: exact" if row.comparison == "evidence" else ""
    doc = bounds.get((row.role, row.family))
    entry = (doc or {}).get("bounds", {}).get(row.tensor, {}).get(row.metric)
    if entry is None:
        return row.family
    top = dominant_term(doc, entry)
    controls = ", ".join(doc.get("control_runs", []))
    return f"{row.family}: {top}" + (f" (controls {controls} vs {doc['reference_run']})" if top == "k x control"
                                      else "")


def row_view(row: Row, bounds: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    """A verdict row as the verdict writes it, with the ratio as a number and what set its bound."""
    return {**row.to_json(), "ratio_value": ratio_of(row), "set_by": set_by(row, bounds)}


def rollout_deltas(docs: RunDocs) -> dict[str, np.ndarray]:
    """|r0 reference actor logprob - vLLM sampler logprob| per response token, by precision (empty if absent)."""
    from safetensors import safe_open

    layout, ref = docs.layout, docs.reference
    rollout = layout.rollout(ref.get("primary_vllm_tp", 1)) / "rollout.safetensors"
    control = (ref.get("controls") or ["r0"])[0]
    if not rollout.is_file():
        return {}
    with safe_open(str(rollout), framework="numpy") as f:
        mask, sampler = f.get_tensor("response_mask_BT"), f.get_tensor("sampler_logprobs_BT")
    out = {}
    for precision in ref.get("precisions", []):
        scores = layout.scores(precision, control, "actor") / "step0" / "outputs.safetensors"  # step 0: on-policy
        if scores.is_file():
            with safe_open(str(scores), framework="numpy") as f:
                logp = f.get_tensor("logprobs_BT")
            # in fp32, as the reference summary computes it, so the histogram matches its max and mean
            out[precision] = np.abs(logp[mask] - sampler[mask]).astype(np.float64)
    return out


def fmt(v: Any) -> str:
    """A number for a table cell."""
    if isinstance(v, str):
        return v
    if isinstance(v, bool) or v is None:
        return str(v)
    return f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v)
