"""The rounds section: the run that installs the trained actor's weights into vLLM live, and its rejection probes."""

from __future__ import annotations

from dataclasses import dataclass

from qualify.matrix.engine_names import engine_name_problem
from qualify.matrix.values import PRECISIONS, Precision, distinct

ROUNDS_PROBES = ("stale", "wrong-shard", "missing-ack", "duplicate-ack", "warm-cache")
"""The rejection probes of a rounds run (qualify.rounds.probes implements each)."""
MIN_ROUNDS = 2
"""The fewest rounds a rounds run has: an install needs a round after it."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Rounds:
    """The rounds run (`qualify rounds`): live actor-weight installation into vLLM, and its rejection probes."""

    engine: str = "torch-tp"
    """Candidate engine that trains the actor between rounds (a registry name or 'package.module:factory')."""
    rounds: int = 2
    """Rounds (round 0 trains with the reference rollout; the last round only rolls out); >= 2."""
    vllm_tp: int | None = None
    """vLLM TP degree of the rollout engine (default: the first of rollout.vllm_tp)."""
    train_tp: int = 1
    """TP degree of the training step."""
    train_precision: Precision = "fp32"
    """Precision of the training step: fp32, or bf16 (bf16 compute, FP32 master weights and updates). An engine that
    claims seed 002's exact tier (candidates.rollout_exact) makes the claim in the rollout's precision: train in
    rollout.dtype for its row after each weight sync to be judged rather than reported."""
    probes: tuple[str, ...] = ROUNDS_PROBES
    """Rejection probes to run (empty: none)."""

    def __post_init__(self) -> None:
        problem = engine_name_problem(self.engine)
        if problem:
            raise ValueError(f"engine: {problem}")
        if self.rounds < MIN_ROUNDS:
            raise ValueError(f"rounds must be >= {MIN_ROUNDS} (an install needs a round after it), got {self.rounds}")
        if self.train_tp < 1 or (self.vllm_tp is not None and self.vllm_tp < 1):
            raise ValueError("vllm_tp and train_tp must be >= 1")
        if self.train_precision not in PRECISIONS:
            raise ValueError(f"train_precision: {self.train_precision!r} is not one of {', '.join(PRECISIONS)}")
        distinct("probes", self.probes, nonempty=False)
        unknown = sorted(set(self.probes) - set(ROUNDS_PROBES))
        if unknown:
            raise ValueError(f"probes: unknown {unknown} (known: {', '.join(ROUNDS_PROBES)})")
