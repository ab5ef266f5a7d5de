"""`qualify reference`: models, rollout capture at every vLLM TP degree, targets, scored controls.

Every step writes a resumable stage directory (qualify.stages): complete outputs are skipped,
partial ones redone. The first vLLM TP degree's rollout feeds everything downstream; the others
are captured to check that TP does not change the rollout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from qualify.compare import step_dir
from qualify.errors import EvidenceError, FrozenError, QualifyError
from qualify.layout import RunLayout
from qualify.matrix import MEGATRON_ENGINES, Capture, Matrix, Models
from qualify.models.family import model_dirs
from qualify.ppo.objective import step_rows
from qualify.reference.context import ScoringContext
from qualify.reference.evidence import load_targets, model_config, write_role
from qualify.rollout.capture import capture_rollout, load_rollout
from qualify.rollout.meta import read_rollout_meta
from qualify.schema import to_dict
from qualify.stagelog import StageLog
from qualify.stages import (
    prepare_stage,
    require_complete,
    reuse_complete,
    seal,
    stage_info,
    stage_is_complete,
    write_tensor_stage,
)
from qualify.store import read_json, read_tensors, write_json
from qualify.versions import git_state, provenance


def prepare_models(models: Models, layout: RunLayout, resolve: Callable[[str], Path]) -> dict[str, Path]:
    """The four model directories: made from the seed (tiny) or the matrix's checkpoints (paths resolved by resolve,
    Matrix.resolve)."""
    if models.tiny is not None:
        from qualify.models.tiny import make_tiny_family

        return make_tiny_family(models.tiny, layout.models)
    paths = model_dirs(models, layout.models, resolve)
    for role, path in paths.items():
        if not (path / "config.json").is_file():
            raise QualifyError(f"{role} checkpoint {path} has no config.json (models are never downloaded)")
    return paths


def snapshot_matrix(matrix: Matrix, layout: RunLayout) -> str:
    """Seal the matrix as this reference first saw it; refuse to go on if its frozen sections changed since.

    freeze takes its rule (k, floors) from this snapshot, and the candidate stage compares the live
    matrix with it, so nothing read later from an unprotected file can widen a bound.
    """
    from qualify.acceptance import frozen_field_differences, read_snapshot

    out, data = layout.matrix_snapshot, to_dict(matrix)
    if stage_is_complete(out):
        changed = frozen_field_differences(read_snapshot(out / "matrix.json"), data)
        if changed:
            raise FrozenError(f"the matrix changed since the reference in {layout.reference} started: "
                              f"{'; '.join(changed[:3])} (use another --out directory)")
        return stage_info(out)["digest"]
    prepare_stage(out)
    write_json(out / "matrix.json", data)
    return seal(out, main="matrix.json")


def capture_all(capture: Capture, layout: RunLayout, models: dict[str, Path], log: StageLog,
                rollout_source: Path | None = None) -> dict[int, str]:
    """Capture the rollout at every vLLM TP degree (or reuse rollout_source/tp<N>); return digest per degree."""
    cfg = model_config(models["actor"])
    digests = {}
    for tp in capture.rollout.vllm_tp:
        source = None if rollout_source is None else Path(rollout_source) / f"tp{tp}"
        if source is not None and not source.is_dir():
            raise QualifyError(f"--rollout {rollout_source} has no tp{tp}/ directory (the matrix's vllm_tp is "
                               f"{list(capture.rollout.vllm_tp)})")
        what = f"capture rollout: vLLM TP{tp}" if source is None else f"reuse rollout TP{tp} from {source}"
        with log.step(what) as step:
            digests[tp] = capture_rollout(capture, models["actor"], tp, layout.rollout(tp), source=source,
                                          vocab_size=cfg["vocab_size"], eos_token_id=cfg.get("eos_token_id"),
                                          on_reuse=step.skip)
    return digests


def tp_agreement(vllm_tp: tuple[int, ...], layout: RunLayout) -> dict[str, Any]:
    """Tokens and sampler logprobs of every captured TP degree against the primary one (the first)."""
    primary = vllm_tp[0]
    base = load_rollout(layout.rollout(primary))
    report = {}
    for tp in vllm_tp[1:]:
        other = load_rollout(layout.rollout(tp))
        same_shape = other["input_ids_BT"].shape == base["input_ids_BT"].shape
        tokens_equal = same_shape and bool((other["input_ids_BT"] == base["input_ids_BT"]).all())
        delta = ((other["sampler_logprobs_BT"] - base["sampler_logprobs_BT"]).abs().max().item()
                 if tokens_equal else None)
        report[f"tp{tp}_vs_tp{primary}"] = {"tokens_equal": tokens_equal, "logprob_max_abs": delta}
    return report


def make_targets(ctx: ScoringContext, log: StageLog) -> str:
    """Compute and seal the targets (once); return their digest."""
    from qualify.reference.targets import TARGETS_FILE, compute_targets, targets_meta

    out, digest = ctx.layout.targets, ctx.rollout_digest
    if reuse_complete(out, ctx.settings, "targets"):
        return stage_info(out)["digest"]
    with log.step("targets: reference logprobs, rewards, values, GAE (fp32)"):
        rollout = load_rollout(ctx.layout.rollout(ctx.primary_tp), digest)
        vocab = model_config(ctx.models["actor"])["vocab_size"]
        targets = compute_targets(ctx.objective, ctx.reference, ctx.rollout, ctx.models, rollout, vocab)
        return write_tensor_stage(out, TARGETS_FILE, targets, "targets.json",
                                  targets_meta(ctx.objective, ctx.rollout, digest),
                                  {"rollout_digest": digest, "settings": ctx.settings})


def score_all(ctx: ScoringContext, candidate_tp: tuple[int, ...], log: StageLog,
              pack_tokens: int | None = None) -> tuple[ScoringContext, list[str]]:
    """Every precision x control x role, every precision's r0 first (a control kept as a summary is measured against
    its families' r0 while it runs: qualify.reference.summary); returns the context with the targets' digest and the
    control names. pack_tokens: candidates.pack_tokens, the packed control's budget."""
    from qualify.reference.step import controls_of

    ctx = replace(ctx, targets_digest=make_targets(ctx, log))
    controls = controls_of(ctx.reference, candidate_tp, pack_tokens)
    precisions, layout = ctx.reference.precisions, ctx.layout
    r0_first = sorted(precisions, key=lambda p: p != "fp32")  # fp32-r0 is every family's base
    order = [(controls[0], p) for p in r0_first] + [(c, p) for c in controls[1:] for p in precisions]
    scoring = Scoring(ctx, [c.name for c in controls], log)
    for control, precision in order:
        for role in ctx.objective.roles:
            what = f"reference {precision} {control.name} {role}"
            if reuse_complete(layout.scores(precision, control.name, role), ctx.settings, what):
                log.skip(f"score {precision} {control.name} {role}")
                continue
            summarized = ctx.reference.evidence != "full" and control is not controls[0]
            with log.step(f"score {precision} {control.name} {role}" + (" (kept as a summary)" if summarized else "")):
                scoring.score(control, precision, role)
    return ctx, [c.name for c in controls]


class Scoring:
    """One reference run scored and sealed: in full, or (a control) as a summary."""

    def __init__(self, ctx: ScoringContext, controls: list[str], log: StageLog | None = None) -> None:
        self.ctx, self.layout, self.models, self.controls, self.log = ctx, ctx.layout, ctx.models, controls, log
        self.rollout = load_rollout(ctx.layout.rollout(ctx.primary_tp), ctx.rollout_digest)
        self.targets = load_targets(ctx.layout, ctx.targets_digest)
        self.vocab = model_config(ctx.models["actor"])["vocab_size"]
        self.verified: set[Path] = set()  # r0 directories whose seal this stage has checked (qualify.stages)
        from qualify.resident import Resident

        self.resident = Resident()  # what the records measure again and again, on the metrics GPU when it fits

    def fits_on_device(self, role: str) -> bool:
        """Whether a control run's gradients, updates and moments (four fp32 copies of the model a step) fit twice in
        what the metrics GPU has free now: then they stay there, where its record measures them (Resident), and are
        never copied to the host (a control kept as a summary writes none of them)."""
        if self.resident.device is None or self.resident.device.type != "cuda":
            return False
        ppo = self.ctx.objective.ppo
        from qualify.store import tree_bytes

        need = 4 * ppo.epochs * ppo.minibatches * tree_bytes(self.models[role])
        return 2 * need <= self.resident.room()

    def score(self, control: Any, precision: str, role: str) -> None:
        """Score and seal one run. Under reference.evidence summary or lean, a run that is a control of some family
        is measured against it while in memory (its record); a control other than r0 is then kept as that summary
        alone (qualify.reference.summary), an r0 in full with its record, or under lean with its outputs and
        gradients and a record that also holds what freeze needs of its updates and moments."""
        import torch

        from qualify.models.checkpoint import initial_parameters
        from qualify.models.hf import load_model
        from qualify.reference.step import run_role
        from qualify.reference.summary import (
            control_record,
            expected_run_bytes,
            recorded_families,
            require_space,
            write_summarized_role,
        )

        ctx, name = self.ctx, f"{precision}-{control.name}"
        out = self.layout.scores(precision, control.name, role)
        ppo = ctx.objective.ppo
        need, basis = expected_run_bytes(self.layout, self.models[role], role, ppo.epochs * ppo.minibatches)
        require_space(out, need, basis, f"scoring {name} {role}")
        started = time.monotonic()
        master = load_model(self.models[role], role, control.attn_impl)
        loaded = time.monotonic()
        lean = ctx.reference.evidence == "lean" and control.name == self.controls[0]  # r0: outputs and gradients
        summarized = ctx.reference.evidence != "full" and control.name != self.controls[0] \
            and bool(recorded_families(name, self.controls))
        with torch.enable_grad():
            result = run_role(ctx, role, precision, control, master, self.rollout, self.targets, self.vocab,
                              self.models[role], keep_on_device=summarized and self.fits_on_device(role))
        ran = time.monotonic()
        info = {"precision": precision, "control": control.name, "role": role, "attn_impl": control.attn_impl,
                "microbatches": control.microbatches, "reverse_rows": control.reverse_rows, "tp_split": control.tp,
                "seconds": round(time.monotonic() - started, 3), "rollout_digest": ctx.rollout_digest,
                "targets_digest": ctx.targets_digest, "settings": ctx.settings} \
            | ({"fused_projections": True} if control.fused else {}) \
            | ({"optimizer_order": "reordered"} if control.adam_form == "reordered" else {}) \
            | ({"optimizer_form": "fused"} if control.adam_form == "fused" else {}) \
            | ({"fused_norm": True} if control.fused_norm else {}) \
            | ({"pack_tokens": control.pack_tokens} if control.pack_tokens is not None else {})
        recorded = time.monotonic()
        if ctx.reference.evidence == "full" or not (lean or recorded_families(name, self.controls)):
            write_role(out, result, info)
        else:
            record = control_record(ctx, role, name, result, self.controls, initial_parameters(self.models[role]),
                                    base=lean, verified=self.verified, resident=self.resident)
            recorded = time.monotonic()
            if control.name == self.controls[0]:
                write_role(out, result, info, record, lean=lean)
            else:
                write_summarized_role(out, result, info, record)
        if self.log is not None:  # where a run's time goes (information: not part of the evidence)
            self.log.note(f"  {name} {role}: load {loaded - started:.1f} s, run {ran - loaded:.1f} s, record "
                          f"{recorded - ran:.1f} s, write and seal {time.monotonic() - recorded:.1f} s")


def rollout_mismatch(ctx: ScoringContext, controls: list[str]) -> dict[str, Any]:
    """Train-vs-rollout per precision, decomposed (qualify.reference.targets.decompose_mismatch), on the rows of
    step 0 (on-policy: the rollout's weights).

    The sampler's logprobs are vLLM's processed formula. At fp32 the reference's processed formula is the
    targets' processed_logprobs_BT; at another precision it is that precision's scored (full-formula)
    logprobs minus the fp32 log kept mass, on the fp32 reference's kept set. A token is a kept-set difference beyond
    the floor plus 10 x the larger of the precision's own spread from fp32 and the rollout's precision's spread.
    """
    import torch

    from qualify.reference.targets import KEPT_SET_FLOOR, TARGETS_FILE, decompose_mismatch

    layout = ctx.layout
    rollout = load_rollout(layout.rollout(ctx.primary_tp))
    targets = read_tensors(layout.targets / TARGETS_FILE)
    if "processed_logprobs_BT" not in targets:
        raise EvidenceError(f"targets in {layout.targets} predate the sampler evidence (no processed_logprobs_BT): "
                            "run the reference again in another --out directory")
    rows = step_rows(rollout["response_mask_BT"].shape[0], ctx.objective.ppo.epochs, ctx.objective.ppo.minibatches)[0]
    mask = rollout["response_mask_BT"][rows]
    where = torch.nonzero(mask) + torch.tensor([rows.start, 0])
    sampler = rollout["sampler_logprobs_BT"][rows][mask]
    processed_fp32, full_fp32, kept_mass = (targets[f"{name}_BT"][rows][mask]
                                            for name in ("processed_logprobs", "full_logprobs", "log_kept_mass"))
    fulls = {precision: read_tensors(layout.scores(precision, controls[0], "actor") / step_dir(0)
                                     / "outputs.safetensors")["logprobs_BT"][mask]
             for precision in ctx.reference.precisions}
    spread = {precision: float((full - full_fp32).abs().max()) if mask.any() else 0.0
              for precision, full in fulls.items()}
    # the rollout's own rounding: a bf16 rollout differs from the fp32 formula by bf16's error on every token, which is
    # numerical, not a kept-set difference (without this the fp32 row of a bf16 rollout listed nearly every token)
    rollout_spread = spread.get(ctx.rollout.dtype, 0.0)
    report = {}
    for precision, full in fulls.items():
        processed = processed_fp32 if precision == "fp32" else torch.where(
            torch.isinf(processed_fp32), processed_fp32, full - kept_mass)
        limit = KEPT_SET_FLOOR + 10 * max(spread[precision], rollout_spread)
        report[precision] = decompose_mismatch(sampler, processed, full, where, limit)
    return report


def require_routing_setting(routing: str | None, engines: tuple[str, ...], actor_dir: Path,
                            tps: tuple[int, ...] = (1,)) -> None:
    """rollout.routing is required for a MoE actor and refused for a dense one (a tiny family's matrix says so when it
    loads; a checkpoint's model type is known once its config is read), and megatron (candidates.engines) runs a
    Qwen3-MoE actor at TP 1 only (candidates.tp tps: megatron-core trains MoE under TP with sequence parallelism
    alone, which the norms of its local spec refuse)."""
    from qualify.models.hf import model_type

    moe = model_type(actor_dir) == "qwen3_moe"
    if moe != (routing is not None):
        raise QualifyError(f"{actor_dir} is a {'Qwen3-MoE' if moe else 'dense Qwen3'} actor: rollout.routing (replay "
                           "or recompute) is required for a MoE actor and refused for a dense one")
    megatron = [e for e in engines if e in MEGATRON_ENGINES]
    if moe and megatron and max(tps) > 1:
        raise QualifyError(f"candidates.engines lists {megatron[0]} beside the Qwen3-MoE actor {actor_dir} with "
                           f"candidates.tp {list(tps)}: megatron runs a Qwen3-MoE model at TP 1 only (megatron-core "
                           "trains MoE under TP with sequence parallelism alone, which the norms of its local spec "
                           "refuse); give megatron a matrix of its own with tp [1]")


def routing_agreement(ctx: ScoringContext) -> dict[str, Any] | None:
    """A MoE rollout's routes against the fp32 reference's own routing at the rollout's weights (the targets'
    actor_routes_BTLK), per MoE layer (qualify.models.routing.agreement); None for a dense actor."""
    from qualify.models.routing import agreement
    from qualify.reference.targets import TARGETS_FILE

    rollout = load_rollout(ctx.layout.rollout(ctx.primary_tp))
    if "routes_BTLK" not in rollout:
        return None
    targets = read_tensors(ctx.layout.targets / TARGETS_FILE)
    meta = read_rollout_meta(ctx.layout.rollout(ctx.primary_tp))
    return {"routing": ctx.rollout.routing, "source": meta.routes_source, "moe_layers": meta.moe_layers,
            "reference_fp32_vs_rollout": agreement(rollout["routes_BTLK"], targets["actor_routes_BTLK"])}


def require_sampled_tokens(mismatch: dict[str, Any], where: Path) -> None:
    """Refuse a rollout holding tokens its own sampler logprobs disown (qualify.reference.targets.foreign_tokens):
    no reference summary is written, so nothing can be frozen on it."""
    from qualify.reference.targets import foreign_tokens

    found = foreign_tokens(mismatch)
    if found:
        listed = "; ".join(f"row {t['row']} position {t['position']}: sampler {t['sampler']:.6g}, reference "
                           f"{t['processed']:.6g}" for t in found[:3])
        raise EvidenceError(f"the rollout {where} holds {len(found)} token(s) whose recorded sampler logprob no "
                            f"scored precision of the reference gives ({listed}{' ...' if len(found) > 3 else ''}): "
                            "its tokens or logprobs were changed after sampling, or it was sampled from other "
                            "weights; capture it again")


def run_reference(matrix: Matrix, run_dir: Path, stage: str = "all", rollout: Path | None = None) -> dict[str, Any]:
    """The whole reference stage (or only its capture or scoring half); returns the summary.

    rollout: a directory of sealed tp<N>/ rollouts (for example a committed acceptance's
    reference/rollout) to reuse instead of sampling; each must match the matrix's request and weights.
    """
    layout = RunLayout(Path(run_dir))
    log = StageLog("reference")
    matrix_digest = snapshot_matrix(matrix, layout)
    with log.step("models"):
        models = prepare_models(matrix.models, layout, matrix.resolve)
    require_routing_setting(matrix.rollout.routing, matrix.candidates.engines, models["actor"],
                            matrix.candidates.tp)
    if stage in ("all", "capture"):
        capture_all(matrix.capture, layout, models, log, rollout)
    if stage == "capture":
        return {"stage": "capture", "run_dir": str(run_dir)}
    primary = matrix.rollout.vllm_tp[0]
    require_complete(layout.rollout(primary), f"rollout TP{primary} (run --stage capture first)")
    digest = stage_info(layout.rollout(primary))["digest"]
    ctx, controls = score_all(ScoringContext.of(matrix, layout, digest, ""), matrix.candidates.tp, log,
                             matrix.candidates.pack_tokens)
    from qualify.reference.forced import control_replays

    replays = sorted({str(p.relative_to(layout.reference)) for p in control_replays(ctx, controls, log.step)})
    mismatch = rollout_mismatch(ctx, controls)
    from qualify.reference.summary import evidence_sizes

    require_sampled_tokens(mismatch, layout.rollout(primary))
    rollout_meta = read_rollout_meta(layout.rollout(primary))
    summary = {"matrix": to_dict(matrix), "matrix_digest": matrix_digest, "rollout_digest": digest, "primary_vllm_tp": primary,
               "rollout_digests": {f"tp{tp}": stage_info(layout.rollout(tp))["digest"]
                                   for tp in matrix.rollout.vllm_tp if stage_is_complete(layout.rollout(tp))},
               "tp_agreement": tp_agreement(matrix.rollout.vllm_tp, layout),
               "targets_digest": stage_info(layout.targets)["digest"],
               "controls": controls, "control_replays": replays, "precisions": list(matrix.reference.precisions),
               "rollout_mismatch": mismatch, "routing_agreement": routing_agreement(ctx), "git": git_state(),
               "rollout_platform": rollout_meta.platform,
               # the rollout engine against itself (qualify.rollout.capture.prefill_vs_decode); None before the check
               "rollout_self": rollout_meta.prefill_vs_decode,
               "rollout_source": None if rollout is None else str(rollout),
               "evidence": evidence_sizes(ctx, controls), **provenance()}
    if not layout.reference_summary.is_file():
        write_json(layout.reference_summary, summary)
    return read_json(layout.reference_summary)
