"""One rank of a candidate case (started by qualify.case.launch): K steps of score, loss, backward, step, export.

The PPO objective is the reference's own (qualify.ppo.objective) unless the engine brings its own
(an optional objective() hook, judged the same way); the engine
provides everything framework-specific: TP-sharded model, forward (including the sampler-formula
logprobs, temperature and all), gradient reduction, clipping, the AdamW step and export in HF
names. Rank 0 writes the evidence; every rank contributes its replicated parameters so that the
replica check sees all of them.
Usage: python -m qualify.candidate.worker SPEC.json [SPEC.json ...]
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qualify.candidate.imported import KEY as IMPORTED_KEY
from qualify.candidate.imported import record as record_imported
from qualify.candidate.plugin_contract import (
    ContractError,
    check_grads,
    check_loss,
    check_objective_signature,
    check_outputs,
)
from qualify.case.context import Batch, PackedBatch
from qualify.case.launch import record_failure
from qualify.case.meta import NAME as META_NAME
from qualify.case.meta import CaseMeta
from qualify.case.packing import pack_batch, sample_lengths, unpack
from qualify.case.ranks import init_distributed
from qualify.case.spec import CaseSpec, case_batch, engine_context, read_spec
from qualify.compare import step_dir, write_step
from qualify.engines.registry import get_engine
from qualify.errors import EngineError, EvidenceError
from qualify.hashing import file_digest
from qualify.judge.agreement import agree_case
from qualify.judge.derived import entropy_check, sampler_check
from qualify.judge.dp import dp_group, gather_outputs, rank_rows
from qualify.judge.layer_probe import merge_ranks as merge_layer_ranks
from qualify.judge.layer_probe import probe_rollout_layers
from qualify.judge.layout_probe import merge_ranks, probe_layouts
from qualify.judge.packed import (
    merge_microbatches,
    micro_batches_of_step,
    micro_share,
    require_packed,
    worst_token,
)
from qualify.judge.padding import exposed_rows, padding_found
from qualify.judge.routing_rows import replay_check
from qualify.layout import work_dir
from qualify.models.checkpoint import initial_parameters
from qualify.ppo.objective import (
    grpo_dp_share,
    grpo_share,
    ppo_dp_share,
    ppo_share,
    role_objective,
    rows_of,
    step_rows,
)
from qualify.rollout.capture import load_rollout
from qualify.stages import complete_stage, prepare_stage
from qualify.store import json_safe, read_tensors, write_json
from qualify.tensor_codec import Adam, StepCoding
from qualify.versions import provenance


def objective(engine: Any, spec: CaseSpec, scores_BT: torch.Tensor, batch: Batch, targets: dict[str, torch.Tensor],
              share: Any = None, gives_share: bool = True,
              packed: PackedBatch | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The role's loss and judged outputs: the engine's own objective when it brings one, else the harness's.

    An engine qualifies its own loss code (normalizer, masking, clipping, KL placement) by implementing
    objective(role, ppo, scores_BT, response_mask_BT, targets) -> (loss, outputs) with the same output
    names as qualify.ppo.objective.role_objective; it is also given share= (this rank's share of the step:
    qualify.ppo.objective.PPOShare, the step's global normalizers; GRPOShare, also the rank's advantages) where
    gives_share (qualify.candidate.plugin_contract.check_objective_signature), and under GRPO grpo= (the matrix's
    section). packed: the micro-batch of a packed case the scores were unpacked from (its entropy is unpacked alike).
    """
    own = getattr(engine, "objective", None)
    given = {} if spec.grpo is None else {"grpo": spec.grpo}
    ours = given | {"share": share}
    if own is None:
        return role_objective(spec.role, spec.ppo, scores_BT, batch.response_mask_BT, targets, **ours,
                              entropy_BT=policy_entropy(engine, spec, required=True, packed=packed,
                                                         seq_len=scores_BT.shape[1]))
    result = own(spec.role, spec.ppo, scores_BT, batch.response_mask_BT, targets, **(ours if gives_share else given))
    if not isinstance(result, tuple) or len(result) != 2:
        raise ContractError(f"engine {spec.engine}: objective() returned {type(result).__name__}; expected a pair "
                            "(loss, outputs)")
    loss, outputs = result
    check_loss(spec.engine, loss)
    with torch.no_grad():  # what the harness's own objective gives for the same inputs: names, shapes, masking
        # an own objective may compute its own entropy
        entropy_BT = policy_entropy(engine, spec, required=False, packed=packed, seq_len=scores_BT.shape[1])
        if entropy_BT is None and spec.role == "actor" and spec.ppo.entropy_coef > 0:
            entropy_BT = torch.zeros_like(scores_BT)  # only the outputs' names and shapes are read
        _, expected = role_objective(spec.role, spec.ppo, scores_BT.detach(), batch.response_mask_BT, targets, **ours,
                                     entropy_BT=None if entropy_BT is None else entropy_BT.detach())
    check_outputs(spec.engine, outputs, expected, batch.response_mask_BT)
    return loss, outputs


def policy_entropy(engine: Any, spec: CaseSpec, required: bool, packed: PackedBatch | None = None,
                   seq_len: int = 0) -> torch.Tensor | None:
    """The actor's entropy per token from the forward score() just ran (the engine's entropy() hook, differentiable)
    when the matrix has an entropy bonus; None otherwise. required: an engine without it is refused in one line.
    packed: the packed micro-batch score() ran on, whose (1, N) entropy is unpacked to its rows (seq_len positions)."""
    if spec.role != "actor" or spec.ppo.entropy_coef == 0:
        return None
    hook = getattr(engine, "entropy", None)
    entropy_BT = hook() if hook is not None else None
    if entropy_BT is None and required:
        raise EngineError(f"engine {spec.engine}: ppo.entropy_coef {spec.ppo.entropy_coef} needs the entropy of the "
                          "policy from the forward score() ran, and the engine has no entropy() hook (or it gave none); "
                          "see qualify.engines.base.TrainEngine")
    if entropy_BT is not None and packed is not None:
        entropy_BT = unpack(entropy_BT, packed, seq_len)
    return entropy_BT


def step_share(spec: CaseSpec, targets: dict[str, torch.Tensor], mask_BT: torch.Tensor, offset: int,
               group: Any) -> Any:
    """This rank's share of the step: the step's normalizers (from every DP rank at DP > 1) and under GRPO its rows'
    advantages (from the step's groups)."""
    if spec.grpo is None:
        return ppo_share(mask_BT) if group is None else ppo_dp_share(mask_BT, group)
    if group is None:
        return grpo_share(spec.grpo, targets["score_B"], mask_BT)
    return grpo_dp_share(spec.grpo, targets["score_B"], mask_BT, offset, group)


def report_logprobs(engine: Any, outputs: dict[str, torch.Tensor], batch: Batch,
                    packed: PackedBatch | None = None) -> None:
    """The judged logprobs are the engine's in its declared formula when its logprobs() hook gives them (the
    loss was built from score()'s full formula either way); response positions only, 0 elsewhere. packed: the
    micro-batch the hook's (1, N) logprobs are of (batch: its rows)."""
    hook = getattr(engine, "logprobs", None)
    declared_BT = hook() if hook is not None and "logprobs_BT" in outputs else None
    if declared_BT is not None:
        if packed is not None:
            declared_BT = unpack(declared_BT.float().cpu(), packed, batch.input_ids_BT.shape[1])
        mask_BT = batch.response_mask_BT
        outputs["logprobs_BT"] = torch.where(mask_BT, declared_BT.float().cpu(), torch.zeros((), dtype=torch.float32))


def reported_router_outputs(engine: Any, spec: CaseSpec) -> dict[str, torch.Tensor]:
    """A MoE actor's router logits and routing weights from its router_outputs() hook (judged as outputs); {} for
    a dense model or an engine without the hook (then the reference's are missing in the candidate)."""
    hook = getattr(engine, "router_outputs", None)
    found = hook() if spec.role == "actor" and hook is not None else None
    return {k: v.detach().float().cpu() for k, v in (found or {}).items()}


def own_logits_check(engine: Any, spec: CaseSpec, scores_BT: torch.Tensor, batch: Batch,
                     offset: int, packed: PackedBatch | None = None) -> dict[str, Any] | None:
    """The actor's scores against the sampler formula of its own logits (qualify.judge.derived.sampler_check);
    None where the engine exposes no logits. packed: the micro-batch the hook's (1, N, V) logits are of."""
    hook = getattr(engine, "logits", None)
    logits = hook() if spec.role == "actor" and hook is not None else None
    if logits is None:
        return None
    if packed is not None:
        logits = unpack(logits, packed, batch.input_ids_BT.shape[1])
    return sampler_check(logits, batch.input_ids_BT, scores_BT, batch.response_mask_BT, spec.temperature,
                         spec.vocab_size, offset)


def own_entropy_check(engine: Any, spec: CaseSpec, outputs: dict[str, torch.Tensor], batch: Batch,
                      offset: int, packed: PackedBatch | None = None) -> dict[str, Any] | None:
    """With an entropy bonus, the actor's reported entropy against the entropy of its own logits
    (qualify.judge.derived.entropy_check); None where the engine exposes no logits. packed: as own_logits_check."""
    hook = getattr(engine, "logits", None)
    logits = hook() if hook is not None and "entropy_BT" in outputs else None
    if logits is None:
        return None
    if packed is not None:
        logits = unpack(logits, packed, batch.input_ids_BT.shape[1])
    return entropy_check(logits, outputs["entropy_BT"], batch.response_mask_BT, spec.temperature, spec.vocab_size,
                         offset)


def packed_step(engine: Any, spec: CaseSpec, batch: Batch, lengths_B: torch.Tensor, targets: dict[str, torch.Tensor],
                share: Any, gives_share: bool, offset: int, first_row: int,
                group: Any) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """One step of a packed case on this rank (qualify.judge.packed): per micro-batch of the rank's rows (the
    rollout's from first_row, the step's from offset; as many as every rank of the DP group runs), score, unpack, its
    share of the loss, backward; returns the step's outputs (the loss the shares' sum) and the worst
    sampler-derivation and entropy-derivation tokens."""
    T, parts, worst, entropies = batch.input_ids_BT.shape[1], [], [], []
    count = micro_batches_of_step(lengths_B, spec.pack_tokens, group)
    for packed in pack_batch(batch, lengths_B, spec.pack_tokens, first_row, count):
        rows, start = batch.rows(packed.rows_S), offset + int(packed.rows_S[0])
        scores_BT = unpack(engine.score(packed), packed, T)
        worst.append(own_logits_check(engine, spec, scores_BT, rows, start, packed))
        loss, outputs = objective(engine, spec, scores_BT, rows, rows_of(targets, packed.rows_S),
                                  micro_share(share, packed.rows_S), gives_share, packed)
        if spec.role == "actor" and spec.ppo.entropy_coef > 0:
            entropies.append(own_entropy_check(engine, spec, outputs, rows, start, packed))
        report_logprobs(engine, outputs, rows, packed)
        engine.backward(loss)
        parts.append(outputs | {"loss": loss.detach().float()})
    return merge_microbatches(parts), worst_token(worst), worst_token(entropies)


def worst_by_step(by_rank: list[list[dict[str, Any] | None]]) -> list[dict[str, Any]] | None:
    """Per step, the worst token over the ranks; None when any rank's engine gave no logits."""
    if not by_rank or any(w is None for rank in by_rank for w in rank) or not by_rank[0]:
        return None
    return [max(step, key=lambda w: w["ratio"]) for step in zip(*by_rank, strict=True)]


def replay_by_step(by_rank: list[list[dict[str, Any] | None]]) -> list[dict[str, Any] | None]:
    """Per step, the rank whose routes differ most from the batch's (qualify.judge.derived.replay_check); None
    for a step where any rank's engine gave no routes."""
    out = []
    for step in zip(*by_rank, strict=True):
        out.append(None if any(r is None for r in step) else max(step, key=lambda r: r["differ"]))
    return out


def gather_replicas(local: dict[str, torch.Tensor]) -> dict[str, float]:
    """Max |difference| of each replicated parameter between this rank and every other (0 means identical)."""
    world = dist.get_world_size()
    worst = {}
    for name in sorted(local):
        t = local[name].detach().float().cpu().contiguous()
        gathered = [None] * world
        dist.all_gather_object(gathered, t)
        worst[name] = max(float((g - gathered[0]).abs().max()) if g.numel() else 0.0 for g in gathered)
    return worst


def gather_all(local: Any) -> list[Any]:
    """Every rank's value, in rank order (padding rows live on the last ranks, the evidence is written by rank 0)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered


def gather_by_rank(local: dict[str, Any]) -> dict[str, Any]:
    """Every rank's dict in one, keys suffixed '@rank<r>'."""
    return {f"{name}@rank{r}": v for r, d in enumerate(gather_all(local)) for name, v in d.items()}


def padded_rows_report(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Rows beyond the real vocabulary must be untouched by the step (bitwise)."""
    return {name: {"rows": int(before[name].shape[0]), "changed_max_abs":
                   float((after[name].float() - before[name].float()).abs().max()) if before[name].numel() else 0.0}
            for name in sorted(before)}


@dataclass
class Trace:
    """What a case's steps leave on this rank for its evidence: each step's tensors, the last step's parameters and
    optimizer state, the probes' results and where the time went (phases_s: information, not evidence)."""

    phases: dict[str, float]
    steps: list[dict[str, Any]] = field(default_factory=list)
    grad_dtypes: dict[str, str] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    starts: list[dict[str, torch.Tensor]] = field(default_factory=list)  # rank 0: each step's start parameters
    sampler: list[dict[str, Any] | None] = field(default_factory=list)
    entropies: list[dict[str, Any] | None] = field(default_factory=list)  # with an entropy bonus: its derivation
    replayed: list[dict[str, Any] | None] = field(default_factory=list)
    layout: dict[str, Any] | None = None
    exact_layers: Any = None


def run_case(spec: CaseSpec, rank: int) -> None:
    """One case on this rank (the process group is up): K optimizer steps; rank 0 seals the evidence."""
    started = time.monotonic()
    rollout, targets = case_inputs(spec)
    engine = get_engine(spec.engine)
    work = work_dir(spec.case_dir)
    work.mkdir(parents=True, exist_ok=True)
    ctx = engine_context(spec, rank, work)
    contract = agree_case(spec, rank)  # before the case's first collective: ranks that disagree stop here, named
    group = dp_group(spec.tp, spec.dp, rank)
    gives_share = check_objective_signature(engine, spec.engine, spec.grpo is not None, spec.dp,
                                            spec.packing == "packed")
    if spec.packing == "packed":
        require_packed(engine, spec.engine, spec.name)
    engine.setup(ctx)
    before = initial_parameters(Path(spec.model_dir))
    padded_before = {k: v.detach().clone() for k, v in engine.padded_rows().items()}
    padding = {"found": padding_found(engine, before, spec.vocab_size, spec.tp, ctx.tp_rank),
               "exposed": exposed_rows(padded_before)}
    trace = Trace(phases={"setup": time.monotonic() - started})  # where the case's time went (information)
    for step in step_rows(rollout["input_ids_BT"].shape[0], spec.ppo.epochs, spec.ppo.minibatches):
        train_step(engine, spec, rank, ctx.dp_rank, rollout, targets, step, group, gives_share, before, trace)
    trace.phases["steps"] = time.monotonic() - started - sum(trace.phases.values())
    ranks = gather_evidence(engine, padded_before, padding, trace)
    engine.close()
    if rank == 0:
        seal_case(spec, engine, trace, ranks, before, contract, started)
    dist.barrier()


def case_inputs(spec: CaseSpec) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The sealed rollout and the frozen targets, each checked against its digest."""
    rollout = load_rollout(Path(spec.rollout_dir), spec.rollout_digest)
    targets_file = Path(spec.targets_dir) / "targets.safetensors"
    if file_digest(targets_file) != spec.targets_digest:
        raise EvidenceError(f"targets {targets_file} do not have the frozen digest {spec.targets_digest}")
    return rollout, read_tensors(targets_file)


def probe_first_step(engine: Any, spec: CaseSpec, batch: Batch, rows: Any, trace: Trace) -> None:
    """Before the first step: the step-0 rows in other layouts, and for a declared rollout_exact actor the rollout's
    layers (both with no gradient)."""
    probing = time.monotonic()
    trace.layout = probe_layouts(engine, batch)
    trace.phases["layout probe"] = time.monotonic() - probing
    if spec.role == "actor" and spec.rollout_exact:  # where the claim breaks, if it does (no gradient)
        probing = time.monotonic()
        trace.exact_layers = probe_rollout_layers(engine, batch, Path(spec.rollout_dir), rows)
        trace.phases["layer probe"] = time.monotonic() - probing


def train_step(engine: Any, spec: CaseSpec, rank: int, dp_rank: int, rollout: dict[str, torch.Tensor],
               targets: dict[str, torch.Tensor], step: Any, group: Any, gives_share: bool,
               before: dict[str, torch.Tensor], trace: Trace) -> None:
    """One optimizer step of this rank's rows: score, loss, backward (padded or packed), the gradients checked, the
    outputs gathered over DP, the optimizer step; its tensors kept in trace."""
    rows, offset = rank_rows(step, spec.dp, dp_rank)
    batch = case_batch(spec, rollout, rows)
    if trace.layout is None:
        probe_first_step(engine, spec, batch, rows, trace)
    share = step_share(spec, rows_of(targets, rows), batch.response_mask_BT, offset, group)
    if spec.packing == "packed":
        lengths_B = sample_lengths(rollout["prompt_mask_BT"][rows], rollout["response_mask_BT"][rows])
        outputs, worst, entropy = packed_step(engine, spec, batch, lengths_B, rows_of(targets, rows), share,
                                              gives_share, offset, rows.start, group)
        loss = outputs["loss"]
        trace.sampler.append(worst)
        if spec.role == "actor" and spec.ppo.entropy_coef > 0:
            trace.entropies.append(entropy)
    else:
        loss, outputs = padded_step(engine, spec, batch, rows_of(targets, rows), share, gives_share, offset, trace)
    grads, trace.grad_dtypes = engine.grads(), engine.grad_dtypes()
    check_grads(spec.engine, grads, trace.grad_dtypes)
    outputs["loss"] = loss.detach().float()
    outputs = gather_outputs(outputs, group)
    outputs["grad_norm"] = engine.step().detach().float().cpu()
    start = trace.params or before
    params, trace.state = engine.params(), engine.optimizer_state()
    trace.steps.append({"outputs": {k: v.float().cpu() for k, v in outputs.items()}, "grads": grads,
                        "updates": {n: p.float().cpu() - start[n].float().cpu() for n, p in params.items()
                                    if n in start},
                        "moments": {f"{k}/{n}": t for k, ts in trace.state.items() for n, t in ts.items()}})
    if rank == 0:  # what the evidence's coding predicts the step's new parameters from (qualify.tensor_codec)
        trace.starts.append(start)
        params = {n: p.detach().float().cpu().clone() for n, p in params.items()}
    trace.params = params


def padded_step(engine: Any, spec: CaseSpec, batch: Batch, targets: dict[str, torch.Tensor], share: Any,
                gives_share: bool, offset: int, trace: Trace) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step of a padded case on this rank: score, the own-logits and routing checks, the objective, backward;
    returns (loss, outputs)."""
    scores_BT = engine.score(batch)
    trace.sampler.append(own_logits_check(engine, spec, scores_BT, batch, offset))
    if batch.routes_BTLK is not None:
        hook = getattr(engine, "routes", None)
        trace.replayed.append(replay_check(hook() if hook is not None else None, batch.routes_BTLK, offset))
    loss, outputs = objective(engine, spec, scores_BT, batch, targets, share, gives_share)
    if spec.role == "actor" and spec.ppo.entropy_coef > 0:
        trace.entropies.append(own_entropy_check(engine, spec, outputs, batch, offset))
    outputs.update(reported_router_outputs(engine, spec))
    report_logprobs(engine, outputs, batch)
    engine.backward(loss)
    return loss, outputs


def gather_evidence(engine: Any, padded_before: dict[str, torch.Tensor], padding: dict[str, Any],
                    trace: Trace) -> dict[str, Any]:
    """What every rank contributes to the evidence, gathered in rank order (every rank takes part, in this order)."""
    return {"replicas": gather_replicas(engine.replicated()),
            "padded": gather_by_rank(padded_rows_report(padded_before, engine.padded_rows())),
            "padding": gather_all(padding), "sampler": gather_all(trace.sampler),
            "entropy": gather_all(trace.entropies) if trace.entropies else None,
            "replayed": gather_all(trace.replayed), "layout": gather_all(trace.layout or {}),
            "layers": gather_all(trace.exact_layers)}


def seal_case(spec: CaseSpec, engine: Any, trace: Trace, ranks: dict[str, Any], before: dict[str, torch.Tensor],
              contract: Any, started: float) -> None:
    """Rank 0: write every step's evidence (coded: qualify.tensor_codec), meta.json (qualify.case.meta.CaseMeta) and
    the seal, whose key adds the code the ranks imported to the resume key."""
    out = Path(spec.case_dir)
    prepare_stage(out)
    writing = time.monotonic()
    write_steps(spec, out, trace)
    trace.phases["code and write"] = time.monotonic() - writing
    meta = case_meta(spec, engine, trace, ranks, before, contract, started)
    write_json(out / META_NAME, json_safe(meta.to_json()))
    key = (spec.resume_key or {}) | {IMPORTED_KEY: record_imported(work_dir(spec.case_dir))}
    complete_stage(out, {"case": spec.name, "rollout_digest": spec.rollout_digest, "key": key})


def write_steps(spec: CaseSpec, out: Path, trace: Trace) -> None:
    """Each step's tensors, coded against what they are predicted from (the step's start and the new parameters)."""
    steps, starts, adam, startable = trace.steps, trace.starts, Adam.of(spec.optimizer), None
    # the coding's predictions on this rank's GPU where it has one (the same bits as the CPU's, in a fraction of
    # the time)
    coding_device = torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" else None
    for k, step in enumerate(steps):
        new = starts[k + 1] if k + 1 < len(starts) else trace.params
        coding = StepCoding(adam, k, steps[k - 1]["moments"] if k else None, starts[k], new,
                            Path(spec.model_dir), startable, device=coding_device)
        try:
            startable = write_step(out / step_dir(k), step, coding=coding)
        except torch.OutOfMemoryError:  # the GPU is full: the same bits from the CPU
            startable = write_step(out / step_dir(k), step, coding=replace(coding, device=None))


def case_meta(spec: CaseSpec, engine: Any, trace: Trace, ranks: dict[str, Any], before: dict[str, torch.Tensor],
              contract: Any, started: float) -> CaseMeta:
    """The case's meta.json (the optional keys only where they apply: an entropy bonus, routing replay, rollout
    layers)."""
    optional = {**({"entropy_derivation": worst_by_step(ranks["entropy"])} if ranks["entropy"] else {}),
                **({"routing_replay": replay_by_step(ranks["replayed"])} if trace.replayed else {}),
                **({"rollout_layers": merge_layer_ranks(ranks["layers"])} if trace.exact_layers is not None else {})}
    return CaseMeta.written(
        grad_dtypes=trace.grad_dtypes,
        state_dtypes={n: str(t.dtype).removeprefix("torch.") for n, t in trace.state.get("exp_avg", {}).items()},
        replica_max_abs=ranks["replicas"], padded_rows=ranks["padded"], padding=ranks["padding"],
        extra_params=sorted(set(trace.params) - set(before)), num_steps=len(trace.steps),
        own_objective=hasattr(engine, "objective"), contract=contract,
        sampler_derivation=worst_by_step(ranks["sampler"]), layout=merge_ranks(ranks["layout"]), **optional,
        case=spec.to_json(), seconds=round(time.monotonic() - started, 3),
        phases_s={k: round(v, 3) for k, v in trace.phases.items()}, **provenance())


def main() -> None:
    """Run every case named on the command line, in order, in one launch (they share engine and TP)."""
    specs = [read_spec(Path(arg)) for arg in sys.argv[1:]]
    if len({(s.tp, s.dp, s.device) for s in specs}) != 1:
        raise EngineError("all cases of one launch must share TP degree, DP degree and device")
    try:
        rank = init_distributed(specs[0])
    except Exception as exc:  # no rank joined (too few GPUs, a rendezvous that failed): every case says why
        for spec in specs:
            record_failure(work_dir(spec.case_dir), int(os.environ.get("RANK", "0")), exc)
        raise
    for spec in specs:
        try:
            run_case(spec, rank)
        except Exception as exc:  # recorded for the verdict's row, then the rank fails as it would
            record_failure(work_dir(spec.case_dir), rank, exc)
            raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
