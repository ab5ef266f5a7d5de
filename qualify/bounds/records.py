"""A control kept as a summary: what freeze needs of it, sealed in place of its gradients, updates and moments.

A reference control (every run but a precision's r0) serves only to measure control errors; no candidate is judged
against it. Under `reference.evidence: summary` (the default) the reference stage measures, while the control is in
memory, everything the control contributes to its families' bounds (qualify.bounds.control_error.pair_record, the
functions freeze runs on a control kept in full) and seals that record with the control's outputs and meta instead
of its tensors: the reference's evidence then grows with the model and the steps (the r0 runs), not with the number
of controls. `reference.evidence: full` keeps every control whole, for a reviewer who wants to measure them again;
freeze makes byte-identical bounds from either (tests/integration/test_evidence_summary.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError
from qualify.store import json_safe, read_json, write_json

RECORD_FILE = "control-errors.json"
RECORD_SCHEMA = "qualify.control-record/1"


def _floats(value: Any) -> Any:
    """value with the strings json_safe wrote for non-finite floats turned back into floats."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return value


def write_record(role_dir: Path, record: dict[str, Any]) -> None:
    """Write a control's record (schema added) into its role directory, before the directory is sealed."""
    write_json(Path(role_dir) / RECORD_FILE, json_safe({"schema": RECORD_SCHEMA, **record}))


def read_record(role_dir: Path) -> dict[str, Any] | None:
    """The record of a control kept as a summary; None for a run kept in full (no record file)."""
    path = Path(role_dir) / RECORD_FILE
    if not path.is_file():
        return None
    record = _floats(read_json(path))
    if record.get("schema") != RECORD_SCHEMA or not isinstance(record.get("families"), dict):
        raise EvidenceError(f"{path}: not a control record of schema {RECORD_SCHEMA} (made by another version of "
                            "qualify: run the reference again in another --out directory)")
    return record


def layer_record(record: dict[str, Any] | None, family: str) -> dict[str, Any] | None:
    """A summarized control's layer metrics against its family's r0 (None when it has none or is kept in full)."""
    if record is None:
        return None
    return record["families"].get(family, {}).get("layers")


def terms_of(objective: Any, role: str, inputs: Any) -> Any:
    """terms(step, run): the run's per-token loss contributions at that step (qualify.ppo.decisions.loss_terms)."""
    from qualify.ppo.decisions import loss_terms

    def terms(step: int, run: Any) -> Any:
        if step >= len(inputs.masks):
            return None
        return loss_terms(role, objective.ppo, objective.grpo, run.outputs, inputs.targets[step], inputs.masks[step])
    return terms


BIAS_GRAD = "grads/score.bias"
"""The critic's value-head bias gradient: the sum over tokens of d loss / d value (qualify.ppo.decisions.bias_terms)."""


def means_of(objective: Any, role: str, inputs: Any) -> Any:
    """means(step, run): the run's per-token contributions to its scalar means at that step
    (qualify.ppo.decisions.mean_terms) and, for a critic, to its value-head bias gradient (BIAS_GRAD: bias_terms, on
    the clip decisions of decided_by where given), where they sum to the run's recorded gradient (else that head is not
    a bias on the value: left out)."""
    from qualify.ppo.decisions import bias_terms, mean_terms

    def means(step: int, run: Any, decided_by: Any = None) -> dict[str, Any]:
        """decided_by: the run whose clip decisions run followed (run is r0 replayed on them), else None."""
        if step >= len(inputs.masks):
            return {}
        args = (role, objective.ppo, objective.grpo, run.outputs, inputs.targets[step], inputs.masks[step])
        out = mean_terms(*args)
        by = None if decided_by is None else decided_by.outputs.get("values_BT")
        bias, name = bias_terms(*args, decided_by=by), BIAS_GRAD.removeprefix("grads/")
        grad = getattr(run, "grads", {}).get(name)
        if bias is not None and grad is not None and grad.numel() == 1 and \
                abs(float(bias.sum()) - float(grad.double())) <= 0.05 * float(bias.abs().sum()) + 1e-6:
            out[BIAS_GRAD] = bias
        return out
    return means
