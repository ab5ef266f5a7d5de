"""A reference control kept as a summary (qualify.bounds.records): measured while it is in memory, then sealed with
its outputs, meta and record, without its gradients, updates, moments and layer activations.

The record holds, per family the control belongs to (qualify.bounds.rule.family_pairs) and per step, what
qualify.bounds.control_error.pair_record measures against the family's r0, or against r0 replayed on the control's
clip decisions where it decided a token otherwise (the replay is held in memory where it fits, else made in a scratch
directory beside the reference, used, and removed). The r0 runs are scored first, so every control finds its families' r0 sealed.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from qualify.bounds.control_error import base_record, pair_record
from qualify.bounds.layers import LAYERS_FILE, layer_metrics, run_layers
from qualify.bounds.records import means_of, terms_of, write_record
from qualify.bounds.rule import FAMILIES, family_pairs
from qualify.compare import RunTensors, StepFiles, next_params, replay_metrics, step_dir
from qualify.errors import EvidenceError
from qualify.layout import RunLayout
from qualify.reference.context import ScoringContext
from qualify.reference.inputs import StepInputs
from qualify.resident import Resident, meminfo
from qualify.rolemeta import RoleMeta
from qualify.runname import RunName
from qualify.stages import complete_stage, prepare_stage, stage_is_complete
from qualify.store import tree_bytes, write_json, write_tensors


def in_memory_steps(result: dict[str, Any], info: dict[str, Any] | None = None) -> list[RunTensors]:
    """run_role's result as the steps freeze reads from a role directory (their meta: the result's, with info, as
    write_role would write it)."""
    meta = RoleMeta.from_json(result["meta"] | (info or {}), "run_role's meta")
    return [RunTensors(s["outputs"], s["grads"], s["updates"], s["moments"], meta) for s in result["steps"]]


def starts_of(steps: list[RunTensors], initial: dict) -> Iterator[dict]:
    """Each step's start parameters (fp64), one held at a time."""
    current = {n: t.double() for n, t in initial.items()}
    for run in steps:
        yield current
        current = next_params(current, run)


def remove_scratch(scratch: Path) -> None:
    """Remove a scratch replay (its key's directory) and the scratch folders it leaves empty."""
    shutil.rmtree(scratch.parent, ignore_errors=True)
    for empty in (scratch.parent.parent, scratch.parent.parent.parent):
        try:
            empty.rmdir()
        except OSError:
            break


def aligned_base(ctx: ScoringContext, role: str, base_name: str, steps: list[RunTensors],
                 inputs: StepInputs, verified: set[Path] | None = None) -> tuple[Sequence[RunTensors], str, Path | None]:
    """(what the control is compared with, its name in the bound file, a scratch directory to remove): the family's
    sealed r0, or r0 replayed on the control's clip decisions where they differ: held in memory when a run of the
    role fits in half the memory available now (replay_fits), else written to scratch, read step by step and removed.
    Either way the same tensors (a sealed copy is read back bit for bit). verified: the r0 directories whose seal the
    caller has checked in this process (each checked once, then kept: an r0 is not hashed again for every
    control)."""
    from qualify.reference.forced import (
        make_replay,
        recorded_decisions,
        replay_dir,
        replay_needed_for,
        run_replay,
        step_decisions,
    )

    precision, layout = RunName.parse(base_name).precision, ctx.layout
    base_dir = layout.scores(precision, "r0", role)
    if verified is None or base_dir not in verified:
        if not stage_is_complete(base_dir):  # scored and sealed before any control (reference.stage.score_all)
            raise EvidenceError(f"{base_dir} is not sealed: a control is summarized against its family's r0")
        if verified is not None:
            verified.add(base_dir)
    decided = replay_needed_for(step_decisions(ctx.objective, role, [s.outputs for s in steps], inputs),
                                recorded_decisions(ctx.objective, role, base_dir, inputs))
    if decided is None:
        return StepFiles(base_dir), base_name, None
    where = replay_dir(layout.reference, precision, role, decided, ctx.settings)
    # named as freeze names a replay it reads (the bound files are the same under either evidence); not kept here
    name = str(where.relative_to(layout.reference))
    if replay_fits(ctx, role, len(steps)):
        result, info = run_replay(ctx, precision, role, decided)
        return in_memory_steps(result, info), name, None
    scratch = layout.scratch_replays / where.parent.name / role
    if scratch.exists():
        shutil.rmtree(scratch)
    make_replay(ctx, precision, role, decided, scratch)
    return StepFiles(scratch), name, scratch


def replay_fits(ctx: ScoringContext, role: str, steps: int) -> bool:
    """Whether a whole run of role fits in half the memory available now (MemAvailable): then a
    control's replay is held in memory beside the control's own run, not written to scratch and read back (a replay
    is 16 bytes per parameter per step)."""
    need = 4 * steps * tree_bytes(ctx.models[role])  # gradients, update and two moments in fp32, per step
    return 2 * need <= meminfo("MemAvailable")


def control_record(ctx: ScoringContext, role: str, run_name: str, result: dict[str, Any], controls: list[str],
                   before: dict, base: bool = False, verified: set[Path] | None = None,
                   resident: Resident | None = None) -> dict[str, Any]:
    """The record of control run_name ('<precision>-<control>') of role: per family it belongs to, each step's
    pair_record against the run it is compared with, and its layer metrics against the family's r0; with base (an
    r0 kept lean), also what freeze needs of its updates and moments (qualify.bounds.control_error.base_record).
    resident: the stage's copies on the metrics GPU (qualify.resident; one made here when not given)."""
    resident = resident or Resident()
    host_steps = in_memory_steps(result)  # on the host, or on the metrics GPU where run_role kept them there
    steps = resident.transient(host_steps)  # measured against every family and replayed: moved to the GPU once
    start = resident.start(role, before)
    layout, inputs = ctx.layout, ctx.inputs()
    terms, means = terms_of(ctx.objective, role, inputs), means_of(ctx.objective, role, inputs)
    optimizer = ctx.objective.optimizer
    # the run's own AdamW replay at each step, measured once whatever the number of families it is a control of
    replays = [replay_metrics(run, step_start, optimizer, k + 1)
               for k, (run, step_start) in enumerate(zip(steps, starts_of(steps, start)))] \
        if base or recorded_families(run_name, controls) else []
    families = {}
    for family in FAMILIES:
        base_name, others = family_pairs(family, controls)
        if run_name not in others:
            continue
        aligned, compared_with, scratch = aligned_base(ctx, role, base_name, steps, inputs, verified)
        base_dir = layout.scores(*RunName.parse(base_name), role)
        # the sealed r0 is every control's of the family: kept for the stage; a replay is this control's alone
        aligned = resident.base(base_dir, aligned) if compared_with == base_name else resident.transient(aligned)
        try:
            if len(aligned) != len(steps):
                raise EvidenceError(f"{run_name} {role} took {len(steps)} step(s), {compared_with} {len(aligned)}")
            records = [pair_record(run, aligned[k], None, optimizer, k + 1, lambda r, s=k: terms(s, r),
                                   lambda r, by=None, s=k: means(s, r, by), replay=replays[k])
                       for k, run in enumerate(steps)]
        finally:
            if scratch is not None:
                remove_scratch(scratch)
        families[family] = {"compared_with": compared_with, "replay_kept": False, "steps": records}
        if "layers" in result and (base_dir / LAYERS_FILE).is_file():
            base_acts, base_grads = run_layers(base_dir)
            grads = {n: t.cpu() for n, t in host_steps[0].grads.items()}  # kept on the GPU by run_role, maybe
            families[family]["layers"] = layer_metrics(result["layers"], base_acts, grads, base_grads)
    record: dict[str, Any] = {"run": run_name, "role": role, "families": families}
    if base:
        record["base"] = base_record(steps, starts_of(steps, start), optimizer, replays)
    return record


def recorded_families(run_name: str, controls: list[str]) -> list[str]:
    """The families run_name is a control of (an r0 is one too: bf16-r0 in fp32-vs-bf16)."""
    return [f for f in FAMILIES if run_name in family_pairs(f, controls)[1]]


def write_summarized_role(out: Path, result: dict[str, Any], info: dict[str, Any], record: dict[str, Any]) -> None:
    """Seal a control kept as a summary: step<k>/outputs.safetensors, meta.json and its record (no gradients,
    updates, moments or layer activations)."""
    prepare_stage(out)
    for k, step in enumerate(result["steps"]):
        write_tensors(out / step_dir(k) / "outputs.safetensors", step["outputs"])
    write_record(out, record)
    write_json(out / "meta.json", result["meta"] | info | {"evidence": "summary"})
    complete_stage(out, info | {"evidence": "summary"})


def evidence_sizes(ctx: ScoringContext, controls: list[str]) -> dict[str, Any]:
    """What the reference's evidence weighs: the whole, the runs kept in full (the r0 runs, and every control under
    reference.evidence full) with their tensor bytes per parameter per optimizer step, the controls kept as summaries
    and the replays."""
    from qualify.store import TensorFile

    layout = ctx.layout
    full, summaries, tensor_bytes, parameter_steps, counts = 0, 0, 0, 0, [0, 0]
    for precision in ctx.reference.precisions:
        for control in controls:
            for role in ctx.objective.roles:
                role_dir = layout.scores(precision, control, role)
                size = tree_bytes(role_dir)
                if (role_dir / step_dir(0) / "grads.safetensors").is_file():
                    full, counts[0] = full + size, counts[0] + 1
                    steps = sorted(role_dir.glob("step*"))
                    grads = TensorFile(role_dir / step_dir(0) / "grads.safetensors")  # a coded file's logical shapes
                    params = sum(_numel(grads.spec(k)[0]) for k in grads)
                    tensor_bytes += sum(tree_bytes(s) - (s / "outputs.safetensors").stat().st_size for s in steps)
                    parameter_steps += params * len(steps)
                else:
                    summaries, counts[1] = summaries + size, counts[1] + 1
    return {"reference_bytes": tree_bytes(layout.reference), "full_runs": counts[0], "full_runs_bytes": full,
            "summaries": counts[1], "summaries_bytes": summaries, "replays_bytes": tree_bytes(layout.reference / "replays"),
            "mode": ctx.reference.evidence,
            "bytes_per_parameter_step": round(tensor_bytes / parameter_steps, 3) if parameter_steps else None}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def expected_run_bytes(layout: RunLayout, model_dir: Path, role: str, steps: int) -> tuple[int, str]:
    """(bytes a run of role may write, how that was found): a run of the same role already kept in full, else four
    fp32 copies of the model a step (gradients, update, two AdamW moments). A control kept as a summary needs as much
    while it is measured: r0 replayed on its decisions is written to scratch, used and removed."""
    for done in sorted(layout.reference.glob(f"scores/*/{role}")):
        if (done / step_dir(0) / "grads.safetensors").is_file() and (done / "_complete.json").is_file():
            return tree_bytes(done), f"the size of {done.relative_to(layout.reference)}"
    model = tree_bytes(model_dir)
    return 4 * steps * model, f"4 x {steps} step(s) x the {role} model's {model / 1e9:.2f} GB"


def require_space(where: Path, need: int, basis: str, what: str) -> None:
    """Refuse to start writing what when the file system holding where has less than need bytes free: a run that
    fills the disk half-way is lost, a refusal before it costs nothing."""
    from qualify.errors import QualifyError

    probe = Path(where)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise QualifyError(f"{what} needs about {need / 1e9:.2f} GB ({basis}), but only {free / 1e9:.2f} GB are free "
                           f"under {probe}: free space, run in another --run directory, or keep less "
                           "(reference.layer_activations: false; reference.evidence: summary or lean)")
