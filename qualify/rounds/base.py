"""What a rounds run starts from: the models, the round-0 rollout and targets, and the logprob bound.

Three cases, best first. With a frozen acceptance the reference evidence is verified against it,
and the bound is the acceptance's rule (k x control + logprob floor) applied to the frozen
control of this very comparison: the reference's vLLM-vs-HF logprob mismatch of v0 in the rollout's precision
(reference.json, rollout_mismatch.<fp32 or bf16>.max_abs: control_precision). With a reference but no acceptance the same
numbers are used unfrozen, and the evidence says so. Without a reference, round 0's rollout is
captured by the rounds engine, its targets are computed here, and the control is measured on it
(recorded as measured in this run, not frozen).

Why not the actor fp32-repeat bound of logprobs_BT: it bounds HF against an HF repeat, which on
CPU is bitwise (control 0, bound = the floor, 1e-6), while vLLM's fp32 kernels differ from HF's
by about 2e-6 at the same weights: that bound would reject a correctly updated engine. It is
still recorded in the evidence next to the bound that is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError
from qualify.layout import RunLayout
from qualify.matrix import Freeze
from qualify.rollout.meta import read_rollout_meta
from qualify.stages import stage_info, stage_is_complete
from qualify.store import read_json


@dataclass(kw_only=True, slots=True)
class Base:
    """The inputs of round 0 and the rule of the logprob bound."""

    models: dict[str, Path]
    """Checkpoint directory per role (actor = v0)."""
    rollout_dir: Path | None
    """The reference rollout (None: round 0 captures its own)."""
    rollout_digest: str | None
    """Its digest."""
    targets_dir: Path | None
    """The reference targets (None: computed for the captured rollout)."""
    targets_digest: str | None
    """Their digest."""
    k: float
    """Multiplier of the control error."""
    floor: float
    """Logprob floor."""
    control: float | None
    """vLLM-vs-HF logprob max |delta| at v0 in the rollout's precision (None: measured in round 0)."""
    source: str
    """Where k, floor and control come from."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Recorded only (the fp32-repeat bound, the acceptance digest)."""

    @property
    def bound(self) -> float:
        """The rule (qualify.bounds.rule) applied to the vLLM-vs-HF control error, with the logprob floor."""
        from qualify.bounds.rule import logprob_bound

        assert self.control is not None, "control not measured yet"
        return logprob_bound(self.control, self.k, self.floor)


def control_precision(summary: dict[str, Any], rollout_dir: Path) -> str:
    """The reference's precision whose train-vs-rollout mismatch is the rounds' control: the rollout's own (its
    sampling.dtype), where the reference scored in it, else fp32. A bf16 rollout's logprobs sit a bf16 rounding from
    any fp32 forward (0.03 on the tiny family), so the fp32 mismatch (3e-5, over the few tokens within its limit)
    would make every correct bf16 round fail its agreement rows."""
    from qualify.models.precision import DTYPE_NAMES

    try:
        dtype = read_rollout_meta(rollout_dir).dtype
    except (OSError, ValueError):  # no rollout.json, or not one a capture writes (EvidenceError)
        return "fp32"
    precision = next((p for p, name in DTYPE_NAMES.items() if name == dtype), "fp32")
    return precision if precision in (summary.get("rollout_mismatch") or {}) else "fp32"


def reference_control(summary: dict[str, Any], rollout_dir: Path, where: Path | str = "reference.json"
                      ) -> tuple[float, str]:
    """(the rounds' control error, its source): the reference's vLLM-vs-HF logprob mismatch max |delta| of v0 in
    the rollout's precision (control_precision)."""
    precision = control_precision(summary, rollout_dir)
    try:
        return float(summary["rollout_mismatch"][precision]["max_abs"]), f"rollout_mismatch.{precision}.max_abs"
    except (KeyError, TypeError) as exc:
        raise EvidenceError(f"{where} has no rollout_mismatch.{precision}.max_abs") from exc


def _reference_numbers(layout: RunLayout, rollout_dir: Path) -> tuple[float, str]:
    return reference_control(read_json(layout.reference_summary), rollout_dir, layout.reference_summary)


def resolve_base(layout: RunLayout, primary_tp: int, models: dict[str, Path], rule: Freeze) -> Base:
    """Base of a rounds run in layout (verifies the acceptance when there is one): the model directories (prepared),
    the primary rollout (vLLM at primary_tp) and targets when the reference made them, and the logprob bound's rule
    (the acceptance's, else the matrix's freeze section)."""
    primary = layout.rollout(primary_tp)
    if layout.acceptance.is_file():
        from qualify.acceptance import Acceptance
        from qualify.bounds.rule import logprob_rule

        acc = Acceptance.load(layout.acceptance, layout.reference)
        doc = acc.document
        k, floor = logprob_rule(doc["rule"])
        control, key = _reference_numbers(layout, primary)
        acc.require_rollout(primary)
        repeat = acc.bounds("actor", "fp32-repeat").get("step0/outputs/logprobs_BT", {}).get("max_abs", {})
        return Base(models=models, rollout_dir=primary, rollout_digest=doc["rollout_digest"],
                    targets_dir=layout.targets, targets_digest=doc["targets_digest"], k=k,
                    floor=floor, control=control,
                    source=f"acceptance {doc['digest']}: rule k x reference {key} + floor",
                    extra={"acceptance_digest": doc["digest"], "fp32_repeat_logprob_bound": repeat.get("bound")})
    floors = rule.floors
    if layout.reference_summary.is_file() and stage_is_complete(primary) and stage_is_complete(layout.targets):
        control, _ = _reference_numbers(layout, primary)
        return Base(models=models, rollout_dir=primary, rollout_digest=stage_info(primary)["digest"],
                    targets_dir=layout.targets, targets_digest=stage_info(layout.targets)["digest"],
                    k=rule.k, floor=floors["logprob"], control=control,
                    source="reference not frozen (no acceptance): matrix rule k x reference rollout_mismatch + floor")
    return Base(models=models, rollout_dir=None, rollout_digest=None, targets_dir=None, targets_digest=None,
                k=rule.k, floor=floors["logprob"], control=None,
                source="no reference: matrix rule k x control measured on round 0's own rollout + floor (not frozen)")
