"""The reference section (the independent Hugging Face reference and its controls) and the freeze section (the
acceptance rule's settings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from qualify.matrix.values import METRIC_KINDS, PRECISIONS, Perturbation, Precision, distinct, finite


@dataclass(kw_only=True, slots=True, frozen=True)
class Reference:
    """The independent Hugging Face reference and its controls."""

    precisions: tuple[Precision, ...] = PRECISIONS
    """Precisions to score; bounds need both fp32 and bf16."""
    repeats: int = 2
    """Independent repeats per precision (at least two)."""
    perturbations: tuple[Perturbation, ...] = ()
    """Extra numerically legitimate controls per precision: microbatch_split (two micro-batches, gradients
    accumulated), batch_order (rows reversed), attn_impl (eager attention), tp_split (one control per
    candidates.tp degree n > 1 at reference time, named tp<n>_split: the reference computed with TP n's reduction
    orders, qualify.reference.tp_numerics; none when candidates.tp has no degree above 1), fused_projections (each
    layer's q/k/v and gate/up as one GEMM, as Megatron computes them: qualify engines that fuse with it),
    optimizer_order (AdamW's arithmetic in another order, as engines' own optimizers round it: every engine steps its
    own optimizer, so qualify every engine with it; qualify.reference.adam_order), fused_adam (AdamW in the form of
    apex's and Transformer Engine's FusedAdam, which Megatron steps: the decay folded into the update and the parameter
    rounded once, a shift common to every entry that bias and norm-weight gradients sum whole), fused_norm (each
    RMSNorm as one fused kernel, F.rms_norm, rounding once, as Megatron, apex and Transformer Engine compute it),
    packed (each step's rows packed into micro-batches of candidates.pack_tokens tokens, as a packed case trains on
    them: position ids restarting per sample, attention within each sample, gradients accumulated over the
    micro-batches with the step's normalizers; qualify.case.packing; required when candidates.packing lists packed),
    combined (one more control with every other listed perturbation at once, tp_split at the largest candidates.tp
    degree, of two optimizer forms the one listed last: an engine differs from the reference in several of these ways
    together, and its error is their sum, which no single control samples; needs at least two others)."""
    logprob_chunk_tokens: int = 64
    """Tokens per chunk of the fp32 log_softmax (never a [tokens, vocab] fp32 tensor)."""
    gradient_checkpointing: bool = False
    """Checkpoint activations in the reference backward."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the reference's forward and backward run."""
    offload: Literal["host"] | None = None
    """host: the FP32 master, its gradients and the AdamW state stay in host memory, only the compute copy is on the
    device (fits a model whose optimizer state one GPU cannot hold); unset: everything on the device."""
    layer_activations: bool = True
    """Keep step 1's per-layer activations of every reference run (what `qualify diagnose` localizes a failing case
    with, and its per-layer bounds are frozen from); false leaves them out (a fifth of an r0 run's bytes at the
    Qwen3-0.6B shape: matrices/README.md) and diagnose then refuses, naming this field."""
    evidence: Literal["summary", "lean", "full"] = "summary"
    """What the reference keeps of each control (every run but a precision's r0, against which candidates are judged):
    summary: its outputs and the control errors freeze needs, measured while it ran (qualify.bounds.records), so the
    evidence grows with the model and the steps, not with the number of controls; lean: as summary, and each r0
    keeps only what candidates are judged against (outputs and gradients: 4 bytes per parameter per step, not 16),
    its updates and moments replaced by what freeze needs of them (their magnitudes, r0's own AdamW replay, its
    start's magnitudes; qualify.bounds.records.base_record); full: every tensor of every control, for a reviewer who
    measures them again. The bounds are the same in all three."""

    def __post_init__(self) -> None:
        distinct("precisions", self.precisions)
        distinct("perturbations", self.perturbations, nonempty=False)
        if "combined" in self.perturbations and len(self.perturbations) < 3:
            raise ValueError("perturbations: combined applies every other listed perturbation at once and needs at "
                             f"least two others, got {list(self.perturbations)}")
        if self.repeats < 2:
            raise ValueError(f"repeats must be >= 2 (controls need independent repeats), got {self.repeats}")
        if self.logprob_chunk_tokens < 1:
            raise ValueError("logprob_chunk_tokens must be >= 1")


@dataclass(kw_only=True, slots=True, frozen=True)
class Freeze:
    """The acceptance rule's settings: bound = k * control_error + floor + quantum (qualify.bounds.rule.FORMULA; the
    quantum, one rounding step of the compute precision, is not a setting)."""

    k: float = 4.0
    """Multiplier on the control error."""
    floors: dict[str, float] = field(default_factory=dict)
    """Absolute floor per metric kind, the least any bound of that kind gets: logprob, value, loss, grad, grad_norm,
    update, target tensors; 'relative' for every relative metric (rel_l2). AdamW's moments have no bound: they are
    judged by derivation from the case's own gradients (qualify.judge.derived). Each bound's floor is the larger
    of this and floor_ulps fp32 rounding steps of the tensor's own magnitude, so keep these small: the control
    error, not a floor, should set a bound."""
    floor_ulps: float = 4.0
    """Per-tensor floor in fp32 rounding steps (ulps) at the reference tensor's largest magnitude (rel_l2: of 1)."""
    quantum: bool = True
    """Add one rounding step of the compute precision (its ulp at the reference magnitude) to the bounds of what the
    contract computes in that precision: in the bf16 families gradients and the critic's values;
    every update carries one fp32 step of its parameter. Quantities computed in fp32 (logprobs, ratio, KL, loss,
    grad norm) get none."""
    require: tuple[str, ...] = ()
    """Branches the reference must exercise before freeze accepts it (qualify.ppo.coverage.BRANCHES): policy_clip_high,
    policy_clip_low, policy_clip_dual, value_clip, grad_clip, kl, padded_rows, adam_past_first_step."""

    def __post_init__(self) -> None:
        from qualify.ppo.coverage import BRANCHES

        finite(self)
        distinct("freeze.require", self.require, nonempty=False)
        unknown_branches = sorted(set(self.require) - set(BRANCHES))
        if unknown_branches:
            raise ValueError(f"freeze.require names unknown branches {unknown_branches} "
                             f"(known: {', '.join(BRANCHES)})")
        if "moment" in self.floors:
            raise ValueError("freeze.floors.moment: AdamW's moments are no longer judged against a bound (they are "
                             "derived from the case's own gradients, qualify.judge.derived); remove it")
        unknown = sorted(set(self.floors) - set(METRIC_KINDS))
        if unknown:
            raise ValueError(f"unknown floor kinds {unknown} (allowed: {', '.join(METRIC_KINDS)})")
        missing = sorted(set(METRIC_KINDS) - set(self.floors))
        if missing:
            raise ValueError(f"floors missing for {missing}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.floor_ulps < 0:
            raise ValueError(f"floor_ulps must be >= 0, got {self.floor_ulps}")
        negative = sorted(kind for kind, floor in self.floors.items() if floor < 0)
        if negative:
            raise ValueError(f"floors must be >= 0: {', '.join(f'{k} {self.floors[k]}' for k in negative)}")

