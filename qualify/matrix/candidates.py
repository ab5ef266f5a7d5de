"""The candidates section: the engines, precisions, degrees, layouts and roles whose every combination is a case, and
what each engine declares or is excused from."""

from __future__ import annotations

from dataclasses import dataclass, field

from qualify.matrix.engine_names import UNPACKED_ENGINES, engine_name_problem
from qualify.matrix.values import PRECISIONS, LogprobFormula, Packing, Precision, Topology, distinct
from qualify.roles import ROLES, Role
from qualify.waivers import WAIVABLE, unknown_checks


@dataclass(kw_only=True, slots=True, frozen=True)
class Candidates:
    """The candidate matrix: every combination of these runs as one case."""

    engines: tuple[str, ...]
    """Engine names from the registry, or 'module:factory' for a user's own engine."""
    precisions: tuple[Precision, ...] = PRECISIONS
    """Precisions."""
    tp: tuple[int, ...] = (1,)
    """Tensor-parallel degrees."""
    dp: tuple[int, ...] = (1,)
    """Data-parallel degrees: a case runs on tp x dp ranks, each DP rank holding a contiguous slice of every
    optimizer step's rows (which dp must divide); normalizers and group statistics are global, gradients summed."""
    max_ranks: int | None = None
    """Leave out the cases whose tp x dp exceeds this (2 on a 2-core machine keeps TP1xDP2 and TP2xDP1 and drops
    TP2xDP2); unset: every combination runs."""
    packing: tuple[Packing, ...] = ("padded",)
    """Batch layouts the cases train on: 'padded' (right-padded (B, T) rows) and 'packed' (remove-padding: each
    micro-batch's whole samples concatenated into one row, position ids restarting per sample, cu_seqlens;
    qualify.case.packing), judged against the same reference and bounds; a packed case is named ...-packed-<role>."""
    pack_tokens: int | None = None
    """Token budget of one packed micro-batch (prompt and response tokens of whole samples, greedy in row order):
    required when packing lists packed or reference.perturbations lists packed."""
    roles: tuple[Role, ...] = ROLES
    """Roles."""
    topologies: tuple[Topology, ...] = ("dedicated",)
    """GPU topologies of the rounds job (the one that runs vLLM and a trainer together): dedicated = vLLM TP + trainer
    TP GPUs, shared = the larger of the two. Candidate jobs always ask for their case's tp x dp GPUs."""
    determinism: dict[str, str] = field(default_factory=dict)
    """Per engine (a name of engines), what it declares across its TP x DP cases: 'bitwise' (every tensor of a TP > 1
    or DP > 1 case must be bitwise its TP1/DP1 case's, or the case fails) or 'bounded' (the default: within the frozen
    bounds; the verdict still records each tensor's tier)."""
    layout_invariant: tuple[str, ...] = ()
    """Engines (names of engines) that declare their forward independent of the micro-batch layout: every case scores
    its step-0 rows one at a time, four at a time and in reverse order (qualify.judge.layout_probe), and a token
    not bitwise the single batch's fails a declared engine's case; other engines' cases report it."""
    rollout_exact: tuple[str, ...] = ()
    """Engines (names of engines) that claim their step-0 logprobs, in the rollout's precision, are bitwise the
    logprobs the rollout sampled with (seed 002's exact tier; qualify.judge.rollout_exact): a token that differs
    fails a declared engine's case in that precision; every other actor case reports the count."""
    vocab_tile: int | None = None
    """torch-tp's logprob path: unset, the logits are gathered whole and log_softmax'd in chunks; a tile width, the
    deterministic vocab-parallel path (qualify.ppo.vocab_parallel: fixed-order merge of per-tile (max, sum-exp)
    partials, bitwise the same for every TP split). Each TP degree x vocab_tile must divide the vocabulary."""
    logprob_formula: LogprobFormula = "full"
    """The formula of the logprobs the engines report (outputs/logprobs_BT), judged against the reference's formula of
    that name: 'full' (log_softmax over the whole vocabulary: what trainers compute) or 'processed' (vLLM's, renormalized
    over the tokens rollout.top_k/top_p/min_p keep). The loss, ratio and KL are built from the full formula either
    way, against the rollout's processed logprobs as old logprobs."""
    waive: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per engine (a name of engines), the checks it is excused from where they cannot be made, by name
    (qualify.waivers.WAIVABLE: 'sampler_derivation', for an engine without a logits() hook). Per engine, as the other
    declarations here: a waiver excuses the engine it names and no other. A waived row passes and every report names
    the waiver beside the verdict; without the waiver the row fails."""

    def __post_init__(self) -> None:
        for name in ("engines", "precisions", "tp", "dp", "packing", "roles", "topologies"):
            distinct(name, getattr(self, name))
        for engine in self.engines:
            problem = engine_name_problem(engine)
            if problem:
                raise ValueError(f"engines: {problem}")
        if any(tp < 1 for tp in self.tp):
            raise ValueError(f"tp must list degrees >= 1, got {list(self.tp)}")
        if any(dp < 1 for dp in self.dp):
            raise ValueError(f"dp must list degrees >= 1, got {list(self.dp)}")
        if self.vocab_tile is not None and self.vocab_tile < 1:
            raise ValueError(f"vocab_tile must be >= 1 or null, got {self.vocab_tile}")
        if self.vocab_tile is not None and self.logprob_formula != "full":
            raise ValueError("vocab_tile (the vocab-parallel logprob path) computes the full formula only: "
                             f"logprob_formula is {self.logprob_formula!r}")
        undeclared = sorted(set(self.layout_invariant) - set(self.engines))
        if undeclared:
            raise ValueError(f"layout_invariant names {undeclared}, which are not among engines {list(self.engines)}")
        undeclared = sorted(set(self.rollout_exact) - set(self.engines))
        if undeclared:
            raise ValueError(f"rollout_exact names {undeclared}, which are not among engines {list(self.engines)}")
        unknown = sorted(set(self.determinism) - set(self.engines))
        if unknown:
            raise ValueError(f"determinism names {unknown}, which are not among engines {list(self.engines)}")
        bad = sorted(f"{e}: {v!r}" for e, v in self.determinism.items() if v not in ("bitwise", "bounded"))
        if bad:
            raise ValueError(f"determinism must be 'bitwise' or 'bounded' per engine, got {', '.join(bad)}")
        self.check_waivers()
        self.check_packing()
        if self.max_ranks is not None and self.max_ranks < min(self.tp) * min(self.dp):
            raise ValueError(f"max_ranks {self.max_ranks} leaves no case (the smallest is tp {min(self.tp)} x dp "
                             f"{min(self.dp)})")


    def check_packing(self) -> None:
        """pack_tokens is a positive budget; packed cases are refused for the built-in engines that cannot take them."""
        if self.pack_tokens is not None and self.pack_tokens < 1:
            raise ValueError(f"pack_tokens must be >= 1 or null, got {self.pack_tokens}")
        if "packed" in self.packing and self.pack_tokens is None:
            raise ValueError("packing lists packed: pack_tokens (the token budget of a packed micro-batch) is required")
        for engine in self.engines if "packed" in self.packing else ():
            if engine in UNPACKED_ENGINES:
                raise ValueError(f"packing lists packed, which engine {engine} cannot take: {UNPACKED_ENGINES[engine]}; "
                                 "give it a matrix with packing [padded]")

    def check_waivers(self) -> None:
        """waive names engines of engines, and waivable checks (qualify.waivers.WAIVABLE), each once per engine."""
        unknown = sorted(set(self.waive) - set(self.engines))
        if unknown:
            raise ValueError(f"waive names {unknown}, which are not among engines {list(self.engines)}")
        for engine, checks in self.waive.items():
            distinct(f"waive.{engine}", checks)
            bad = unknown_checks(checks)
            if bad:
                raise ValueError(f"waive.{engine}: unknown check(s) {bad} (checks that can be waived: "
                                 f"{', '.join(WAIVABLE)})")

