"""The description of one case that the orchestrator hands to every rank of its launch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qualify.matrix import GRPO, PPO, Case, CaseSettings, Optimizer, ppo_as_before
from qualify.schema import from_dict, to_dict
from qualify.store import read_json

if TYPE_CHECKING:
    import torch

    from qualify.case.context import Batch, EngineContext


@dataclass(kw_only=True, slots=True, frozen=True)
class CaseSpec:
    """Everything a rank needs: the case, where the inputs are and their digests, the settings."""

    engine: str
    role: str
    precision: str
    tp: int
    name: str
    model_dir: str
    rollout_dir: str
    targets_dir: str
    rollout_digest: str
    targets_digest: str
    case_dir: str
    temperature: float
    logprob_chunk_tokens: int
    vocab_size: int
    ppo: PPO
    optimizer: Optimizer
    device: str = "cpu"
    logprob_formula: str = "full"
    """candidates.logprob_formula: the formula the engine reports its logprobs in (qualify.ppo.formula)."""
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    resume_key: dict[str, str] | None = None
    """What the case's evidence depends on (spec, engine code, versions, acceptance), recorded in its seal."""
    grpo: GRPO | None = None
    """The matrix's GRPO section (algorithm grpo: the actor's objective is GRPO's); None under PPO."""
    dp: int = 1
    """Data-parallel degree: the launch has tp x dp ranks, rank = dp_rank x tp + tp_rank."""
    determinism: str = "bounded"
    """candidates.determinism of the engine: 'bitwise' holds its TP > 1 and DP > 1 cases to bitwise equality."""
    vocab_tile: int | None = None
    """candidates.vocab_tile: torch-tp's deterministic vocab-parallel logprob path with tiles of this width."""
    layout_invariant: bool = False
    """The engine is among candidates.layout_invariant: its layout probe is judged (qualify.judge.layout_probe)."""
    routing: str | None = None
    """rollout.routing of a MoE family: 'replay' hands the actor the rollout's routes with every batch."""
    rollout_exact: bool = False
    """The engine is among candidates.rollout_exact: its step-0 logprobs in the rollout's precision are judged bitwise
    against the rollout's (qualify.judge.rollout_exact)."""
    rollout_dtype: str | None = None
    """rollout.dtype, the precision the exact claim is made in (set with rollout_exact)."""
    waive: tuple[str, ...] = ()
    """candidates.waive of the engine: the checks its case is excused from where they cannot be made (qualify.waivers);
    recorded in the case's sealed meta.json, where the judge reads it."""
    packing: str = "padded"
    """The case's batch layout: 'packed' trains on micro-batches of whole samples packed into one row each
    (qualify.case.packing), 'padded' on the rows as the rollout lays them out."""
    pack_tokens: int | None = None
    """candidates.pack_tokens, the token budget of a packed micro-batch (set with packing 'packed')."""

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def to_json(self) -> dict[str, Any]:
        """The spec as JSON; grpo, dp and the ppo section's peer settings (qualify.matrix.ppo_as_before) only when set,
        so a PPO DP1 spec (and its resume key) reads as before."""
        data = to_dict(self)
        for key, default in (("grpo", None), ("dp", 1), ("determinism", "bounded"), ("vocab_tile", None),
                             ("layout_invariant", False), ("routing", None), ("rollout_exact", False),
                             ("rollout_dtype", None), ("waive", []), ("packing", "padded"), ("pack_tokens", None)):
            if data[key] == default:
                del data[key]
        data["ppo"] = ppo_as_before(data["ppo"])
        return data


def make_spec(settings: CaseSettings, case: Case, *, model_dir: Path, rollout_dir: Path, targets_dir: Path,
              rollout_digest: str, targets_digest: str, case_dir: Path, vocab_size: int, device: str) -> CaseSpec:
    """The spec a case's ranks read: the case, where its inputs are (with their digests), and the settings."""
    o, r, c = settings.objective, settings.rollout, settings.candidates
    return CaseSpec(engine=case.engine, role=case.role, precision=case.precision, tp=case.tp, name=case.name,
                    model_dir=str(model_dir), rollout_dir=str(rollout_dir), targets_dir=str(targets_dir),
                    rollout_digest=rollout_digest, targets_digest=targets_digest, case_dir=str(case_dir),
                    temperature=r.temperature, logprob_chunk_tokens=settings.reference.logprob_chunk_tokens,
                    vocab_size=vocab_size, ppo=o.ppo, optimizer=o.optimizer, device=device,
                    logprob_formula=c.logprob_formula, top_k=r.top_k, top_p=r.top_p, min_p=r.min_p, grpo=o.grpo,
                    dp=case.dp, determinism=c.determinism.get(case.engine, "bounded"), vocab_tile=c.vocab_tile,
                    layout_invariant=case.engine in c.layout_invariant, routing=r.routing,
                    rollout_exact=case.engine in c.rollout_exact,
                    rollout_dtype=r.dtype if case.engine in c.rollout_exact else None,
                    waive=c.waive.get(case.engine, ()), packing=case.packing,
                    pack_tokens=c.pack_tokens if case.packing == "packed" else None)


def read_spec(path: Path) -> CaseSpec:
    return from_dict(CaseSpec, read_json(path), str(path))


def engine_context(spec: CaseSpec, rank: int, work: Path, *, dp: int | None = None) -> EngineContext:
    """The one way a case's spec becomes what its engine is set up with (the candidate worker, diagnose's and rounds'
    engine runs). dp overrides the spec's DP degree for a run launched on the case's TP ranks alone (diagnose)."""
    from qualify.case.context import EngineContext

    return EngineContext(role=spec.role, precision=spec.precision, tp=spec.tp, rank=rank, device=spec.device,
                         model_dir=Path(spec.model_dir), optimizer=spec.optimizer, temperature=spec.temperature,
                         logprob_chunk_tokens=spec.logprob_chunk_tokens, vocab_size=spec.vocab_size, work_dir=work,
                         logprob_formula=spec.logprob_formula, top_k=spec.top_k, top_p=spec.top_p, min_p=spec.min_p,
                         dp=spec.dp if dp is None else dp, vocab_tile=spec.vocab_tile, routing=spec.routing,
                         rollout_dir=Path(spec.rollout_dir))


def case_batch(spec: CaseSpec, rollout: dict[str, torch.Tensor], rows: slice) -> Batch:
    """The rollout's rows as the engine's batch: a MoE actor replaying routes gets the rollout's routes of them."""
    from qualify.case.context import Batch
    from qualify.errors import EvidenceError

    routes = None
    if spec.routing == "replay" and spec.role == "actor":
        if "routes_BTLK" not in rollout:
            raise EvidenceError("rollout.routing is replay, but the rollout holds no routes (routes_BTLK)")
        routes = rollout["routes_BTLK"][rows]
    return Batch(input_ids_BT=rollout["input_ids_BT"][rows], response_mask_BT=rollout["response_mask_BT"][rows],
                 routes_BTLK=routes)
