"""The bound rule: bound = k x control error + floor + quantum, per (role, tensor, metric), and its parts.

One definition for every stage: freeze makes bounds with it (qualify.bounds.control_error), the acceptance check
re-derives every frozen bound from it (qualify.bounds.check), diagnose's per-layer bounds use it
(qualify.bounds.layers), and the verdict's rule text comes from the entries it writes (qualify.judge.steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

BOUNDS_SCHEMA = "qualify.bounds/4"
"""/2: the loss's control error is the sum of |per-token contribution differences| where that is larger, and updates
are judged by the AdamW replay alone (no update-vs-reference bound). /3: a control that decided a clip otherwise than
the family's r0 is compared with r0 replayed on its decisions (sealed in the reference), as a case is. /4: the
scalar means kl_mean and (GRPO) policy_loss take at least the random-sign scale of their per-token contribution
differences as control error (qualify.bounds.control_error.means_scale_error); later within /4, the critic's
value-head bias gradient takes at least the sum of |per-token contribution differences| (bias_terms; the bound file's
entry says so in control_error_of, and the check re-derives each bound from the control error it records). An
acceptance of an earlier schema is refused: re-freeze."""


FAMILIES = ("fp32-repeat", "bf16-repeat", "fp32-vs-bf16")
"""The bound families of a role: fp32 controls vs fp32 r0, bf16 controls vs bf16 r0, bf16 runs vs fp32 r0."""

MANTISSA_BITS = {"bf16": 7, "fp32": 23}


def ulp(precision: str, magnitude: float) -> float:
    """The spacing of the precision's values at magnitude (0 for 0 or a non-finite magnitude)."""
    if magnitude <= 0 or not math.isfinite(magnitude):
        return 0.0
    return 2.0 ** (math.floor(math.log2(magnitude)) - MANTISSA_BITS[precision])


def quantum(precision: str, metric: str, magnitude: float) -> float:
    """One rounding step of the compute precision: a value rounded to it can land one step away without error.

    Absolute metrics: the ulp at the reference tensor's largest magnitude; rel_l2: the precision's relative
    spacing. Controls rarely sample this for quantized scalars (a bf16 bias gradient can sit in the
    same rounding bucket in every control), so the rule adds it explicitly.
    """
    if metric == "rel_l2":
        return 2.0 ** -MANTISSA_BITS[precision]
    return ulp(precision, magnitude)


def tensor_floor(kind: str, metric: str, magnitude: float, floors: dict[str, float], floor_ulps: float) -> float:
    """The floor of one bound: the matrix's absolute floor of the kind, or floor_ulps fp32 ulps of the tensor's own
    magnitude (of 1 for a relative metric), whichever is larger."""
    scaled = floor_ulps * (2.0 ** -MANTISSA_BITS["fp32"] if metric == "rel_l2" else ulp("fp32", magnitude))
    return max(floors[kind], scaled)


OUTPUT_KINDS = {"logprobs_BT": "logprob", "ratio_BT": "logprob", "kl_BT": "logprob", "values_BT": "value",
                "loss": "loss", "clip_frac": "loss", "kl_mean": "loss", "grad_norm": "grad_norm",
                "logprobs_processed_BT": "logprob",
                # an entropy bonus (ppo.entropy_coef): the policy's entropy per token, a log-sum-exp like the logprobs
                "entropy_BT": "logprob",
                # GRPO (qualify.ppo.objective.grpo_objective): per-row advantages and loss shares, the policy term
                "advantages_B": "target", "seq_loss_B": "loss", "policy_loss": "loss",
                # a MoE actor's routers (qualify.models.routing.ROUTER_OUTPUTS): logits and probabilities
                "router_logits_BTLE": "logprob", "routing_weights_BTLK": "logprob"}
"""The floor kind of each output (qualify.freeze.floors names one floor per kind)."""


def metric_kind(key: str) -> str:
    """Floor kind of a tensor key such as 'grads/model.norm.weight' (or 'step2/grads/...')."""
    if key.startswith("step"):
        key = key.partition("/")[2]
    group, _, name = key.partition("/")
    if group == "outputs":
        return OUTPUT_KINDS[name]
    return {"grads": "grad", "updates": "update"}[group]


FORMULA = "bound = k * control_error + floor + quantum"
"""The rule in one line (the report's texts); RULE spells out each term."""
RULE = ("bound = k * control_error + floor + quantum (per role, tensor, metric; control_error = max over the "
        "family's controls, each compared with the family's r0 replayed on the control's own clip decisions where they "
        "differ (for the loss and the grad norm, scalars whose few control differences cancel by chance, "
        "at least the sum of |per-token loss contribution differences| and the norm of the gradient's difference; for "
        "the scalar means kl_mean and policy_loss at least the L2 norm of their weighted per-token differences; for "
        "the critic's value-head bias gradient, a sum over tokens, at least the sum of |per-token contribution "
        "differences|); "
        "floor = max(floors[kind], floor_ulps fp32 ulps of the reference tensor's largest magnitude); quantum = one rounding step of the compute precision at that magnitude, for what the contract "
        "computes in it: bf16 gradients and values, and one fp32 step of every update)")


def family_pairs(family: str, controls: list[str]) -> tuple[str, list[str]]:
    """(reference run, candidate-like runs) of a family: run names are '<precision>-<control>'."""
    if family == "fp32-repeat":
        return "fp32-r0", [f"fp32-{c}" for c in controls[1:]]
    if family == "bf16-repeat":
        return "bf16-r0", [f"bf16-{c}" for c in controls[1:]]
    return "fp32-r0", [f"bf16-{c}" for c in controls]


def in_compute_precision(key: str) -> bool:
    """Whether the contract computes a tensor in the compute precision (bf16 under bf16): the gradients of the compute
    copy (cast to the FP32 master), the critic's head output and a MoE actor's router logits and routing weights (the
    router's bf16 GEMM; the weights cast to it). Logprobs, ratio, KL, the
    loss and the grad norm are fp32 computations, so no rounding step of bf16 is theirs to spend."""
    group = key.partition("/")[0]
    return group == "grads" or key in ("outputs/values_BT", "outputs/router_logits_BTLE", "outputs/routing_weights_BTLK")


def bound_entry(kind: str, error: float, k: float, floors: dict[str, float], q: float = 0.0,
                floor: float | None = None, magnitude: float | None = None) -> dict[str, Any]:
    """One frozen bound: k x control error + floor + quantum, with its parts (floor: the kind's unless given)."""
    floor = floors[kind] if floor is None else floor
    entry = {"kind": kind, "control_error": error, "floor": floor, "quantum": q, "bound": k * error + floor + q}
    if magnitude is not None:
        entry["magnitude"] = magnitude
    return entry


def logprob_rule(rule: dict[str, Any]) -> tuple[float, float]:
    """(k, the logprob floor) of an acceptance's rule section (as rounds and the report's check of a rounds
    verdict read them); KeyError, TypeError or ValueError when it lacks them."""
    return float(rule["k"]), float(rule["floors"]["logprob"])


def logprob_bound(control: float, k: float, floor: float) -> float:
    """The rounds stage's bound on vLLM-vs-HF logprobs: the rule applied to the fp32 control error (the reference's
    rollout mismatch, or round 0's own) with the logprob floor."""
    return bound_entry("logprob", control, k, {"logprob": floor})["bound"]


@dataclass(frozen=True, slots=True)
class BoundRule:
    """The rule of one family: k, the floors, and the compute precision whose rounding step may be spent."""

    k: float
    floors: dict[str, float]
    floor_ulps: float
    precision: str
    use_quantum: bool

    def entry(self, key: str, metric: str, error: float, magnitude: float, kind: str | None = None,
              q: float | None = None) -> dict[str, Any]:
        kind = kind or ("relative" if metric == "rel_l2" else metric_kind(key))
        if q is None:
            low = self.precision != "fp32" and in_compute_precision(key)
            q = quantum(self.precision, metric, magnitude) if self.use_quantum and low else 0.0
        return bound_entry(kind, error, self.k, self.floors, q,
                           tensor_floor(kind, metric, magnitude, self.floors, self.floor_ulps), magnitude)
