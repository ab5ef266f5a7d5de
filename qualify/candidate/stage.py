"""`qualify candidate`: verify the acceptance, run every case on the frozen rollout, judge, write the verdict.

The cases sharing engine, TP and DP run as one launch of tp x dp ranks (qualify.case.launch: started directly with
torchrun's rank variables, or forked from a warm server on the CPU; under Slurm the job's one srun task is this
stage, which starts them the same way), so no engine's global state leaks into another engine's. Cases whose evidence is complete
and verified are skipped (resume); a case that crashes is a failed case with its log tail in
the verdict, not a crash of the whole stage.
"""

from __future__ import annotations

import fnmatch
import itertools
import shutil
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from qualify.acceptance import Acceptance
from qualify.candidate import WORKER
from qualify.candidate.decided import (
    StepInputs,
    aligned_reference,
    comparable_steps,
    decision_rows,
    own_loss_rows,
    replay_needed,
    run_decisions,
)
from qualify.candidate.derived import derived_rows
from qualify.candidate.formula import declared_formula, explain_formula, formula_bounds, formula_steps
from qualify.candidate.judge import evidence_rows, judge_steps, precision_rows
from qualify.candidate.layout_probe import layout_rows
from qualify.candidate.rollout_exact import exact_rows
from qualify.candidate.routing_rows import replay_rows
from qualify.candidate.schedule import LaunchPlan, case_needs, gpu_budgets, gpu_held, judged_within_memory, torch_gpus
from qualify.candidate.tiers import bitwise_rows, tensor_tiers, tier_summary
from qualify.case.launch import clear_failures, failure_note, launch, write_spec_file
from qualify.case.ranks import device_of
from qualify.case.spec import CaseSpec, make_spec
from qualify.compare import load_steps, params_before_steps
from qualify.engines.registry import preload_modules, require_engine
from qualify.errors import EvidenceError, QualifyError
from qualify.layout import RunLayout, launch_log, work_dir
from qualify.matrix import Candidates, Case, Matrix
from qualify.models.checkpoint import initial_parameters
from qualify.reference.context import ScoringContext
from qualify.resident import Resident
from qualify.stagelog import StageLog
from qualify.stages import stage_info, stage_is_complete
from qualify.store import read_json, write_json
from qualify.tensor_codec import release as release_decoded
from qualify.verdict import VERDICT_SCHEMA, Row, Verdict, make_verdict


def require_frozen_matrix(matrix: Matrix, layout: RunLayout) -> None:
    """Refuse a matrix whose frozen sections differ from the snapshot the reference (and so the acceptance) sealed."""
    from qualify.acceptance import frozen_field_differences, read_snapshot
    from qualify.schema import to_dict

    snapshot = layout.matrix_snapshot / "matrix.json"
    if not snapshot.is_file():
        raise EvidenceError(f"no matrix snapshot at {snapshot}: the reference predates it; rerun 'qualify reference'")
    frozen = read_snapshot(snapshot)
    changed = frozen_field_differences(frozen, to_dict(matrix))
    if changed:
        raise QualifyError(f"the matrix differs from the one frozen in the acceptance: {'; '.join(changed[:3])}"
                           f"{' ...' if len(changed) > 3 else ''} (only 'candidates' may change after a freeze)")
    budget = frozen.get("candidates", {}).get("pack_tokens")
    if "packed" in matrix.candidates.packing and matrix.candidates.pack_tokens != budget:
        raise QualifyError(f"candidates.pack_tokens {matrix.candidates.pack_tokens} is not {budget}, the budget the "
                           "reference's packed control was scored with (frozen in the matrix snapshot): packed cases "
                           "are judged against bounds of their own layout")


def check_engines(candidates: Candidates, source: str) -> None:
    """Every engine the candidates section names is one the registry can build (source: the matrix file)."""
    for name in candidates.engines:
        require_engine(name, where=f" in {source}")


def write_spec(spec: CaseSpec, doc: dict[str, Any]) -> Path:
    """The case's spec.json, with its resume key, in its work directory (next to the evidence directory, outside
    it)."""
    return write_spec_file(replace(spec, resume_key=resume_key(spec, doc)))


def resume_key(spec: Any, doc: dict[str, Any]) -> dict[str, str]:
    """What a complete case must have been made with to be reused: each part a digest, so a mismatch names it."""
    from qualify.engines.registry import engine_identity
    from qualify.stages import fingerprint
    from qualify.versions import dependency_versions

    versions = {k: v for k, v in dependency_versions().items() if k != "qualify"}
    return {"spec": fingerprint({k: v for k, v in spec.to_json().items() if k != "resume_key"}),
            "engine code": fingerprint(engine_identity(spec.engine)), "versions": fingerprint(versions),
            "acceptance": doc["digest"]}


def stale_reason(case_dir: Path, key: dict[str, str]) -> str | None:
    """Why a complete case may not be reused ('engine code changed', ...), or None when its key matches: the key made
    before launch, and the code the ranks imported (qualify.candidate.imported) hashed again now."""
    from qualify.candidate.imported import KEY, digest_now

    recorded = stage_info(case_dir).get("key") or {}
    now = key | {KEY: digest_now(work_dir(case_dir))}
    changed = [part for part in now if now[part] is None or recorded.get(part) != now[part]]
    return f"{', '.join(changed)} changed since it was sealed" if changed else None


def pending_cases(layout: RunLayout, cases: list[Case], specs_by_case: dict[Case, Path], log: StageLog) -> list[Case]:
    """The cases of a launch group that must run: those not sealed, and those sealed with a stale key (removed here,
    before any launch starts, so that a sealed case seen while the launches run is one of this run's or a fresh
    one). specs_by_case: each case's spec file (write_spec)."""
    pending = []
    for c in cases:
        if not stage_is_complete(layout.case(c.name)):
            pending.append(c)
            continue
        reason = stale_reason(layout.case(c.name), read_json(specs_by_case[c])["resume_key"])
        if reason is None:
            log.skip(f"case {c.name}")
            continue
        log.note(f"redo case {c.name}: {reason}")
        shutil.rmtree(layout.case(c.name))
        pending.append(c)
    return pending


def launch_group(layout: RunLayout, pending: list[Case], specs_by_case: dict[Case, Path], device: str,
                 log: StageLog, plan: LaunchPlan | None = None, need: dict[int, int] | None = None) -> dict[str, str]:
    """Run cases sharing engine and TP in one launch (imports are paid once); a failed launch is retried case by
    case, each alone on the GPUs (plan: qualify.candidate.schedule), so that each failure carries its own log and no
    other launch or judge copy took the memory it needed. need: what the launch plans for per GPU. Returns errors by
    case name."""
    if not pending:
        return {}
    plan, need = plan or LaunchPlan(), need or {}
    specs = [specs_by_case[c] for c in pending]
    for c in pending:
        clear_failures(work_dir(layout.case(c.name)))
    group_log = launch_log(layout.case(pending[0].name))
    with plan.admit(need), log.step(f"cases {', '.join(c.name for c in pending)}"):
        code = launch(WORKER, specs, pending[0].world_size, device, group_log, preload_modules(pending[0].engine))
    errors = {}
    for case, spec in zip(pending, specs):
        if stage_is_complete(layout.case(case.name)):
            continue
        if len(pending) > 1:
            with plan.admit(need, alone=True), \
                    log.step(f"case {case.name} (alone, after a failed group launch)"):
                code = launch(WORKER, spec, case.world_size, device, launch_log(layout.case(case.name)),
                              preload_modules(case.engine))
        if not stage_is_complete(layout.case(case.name)):
            errors[case.name] = failure_note(work_dir(layout.case(case.name)),
                                             launch_log(layout.case(case.name)) if len(pending) > 1 else group_log,
                                             code)
    return errors


POLL_S = 2.0
"""Seconds between looks for a newly sealed case while launches run (a look reads each marker's name only)."""


def run_groups(layout: RunLayout, groups: list[list[Case]], specs_by_case: dict[Case, Path], device: str,
               log: StageLog, launches: int, judge_ready: Callable[[], bool], plan: LaunchPlan | None = None,
               needs: Callable[[list[Case]], dict[int, int]] | None = None) -> dict[str, str]:
    """Run the launch groups, launches of them at once (each admitted by plan when it fits its GPUs: needs(group) is
    what it plans for per GPU), and meanwhile judge what is sealed: judge_ready() judges one case whose evidence is
    ready, if any, and says whether it did (it is called again at once when it did, else after POLL_S or when a
    launch ends). Returns errors by case name."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    pending = [p for p in (pending_cases(layout, g, specs_by_case, log) for g in groups) if p]
    errors: dict[str, str] = {}
    if not pending:
        return errors
    plan = plan or LaunchPlan()
    with ThreadPoolExecutor(max(1, min(launches, len(pending)))) as pool:
        running = {pool.submit(launch_group, layout, p, specs_by_case, device, log, plan,
                               needs(p) if needs is not None else None) for p in pending}
        while running:
            done, running = wait(running, timeout=0 if judge_ready() else POLL_S, return_when=FIRST_COMPLETED)
            for future in done:
                errors |= future.result()
    if plan.waited:
        log.note(f"{plan.waited} launch(es) waited for GPU memory (qualify.candidate.schedule)")
    return errors


def marked_complete(path: Path) -> bool:
    """Whether a stage directory holds its marker (cheap: nothing is hashed; stage_is_complete checks it)."""
    from qualify.stages import MARKER

    return (path / MARKER).is_file()


def case_families(case: Case) -> list[tuple[str, str]]:
    """(bound family, reference run) a case is judged against: its precision's repeat family against that
    precision's r0, and under bf16 also fp32-vs-bf16 against fp32-r0 (the case's own precision first)."""
    families = [(f"{case.precision}-repeat", f"{case.precision}-r0")]
    if case.precision == "bf16":
        families.append(("fp32-vs-bf16", "fp32-r0"))
    return families


def seal_replays(ctx: ScoringContext, case: Case, inputs: StepInputs, log: StageLog) -> None:
    """The judge's one computation, made and sealed before any judging: for each reference run the case is compared
    with, that run replayed on the case's clip decisions where they differ from the run's (qualify.reference.forced;
    cases that decided alike share one). The judge, and `qualify report` judging again, only read it."""
    from qualify.reference.forced import ensure_replay, replay_location

    for ref_run, decided in case_replays(ctx, case, inputs):
        precision = ref_run.split("-", 1)[0]
        if stage_is_complete(replay_location(ctx, precision, case.role, decided)):
            continue
        with log.step(f"replay {ref_run} {case.role} on {case.name}'s clip decisions"):
            ensure_replay(ctx, precision, case.role, decided)


def case_replays(ctx: ScoringContext, case: Case, inputs: StepInputs) -> list[tuple[str, list]]:
    """(reference run, the case's decisions to replay it on) for each reference run the case decided a token
    otherwise than (qualify.candidate.decided.replay_needed)."""
    layout, objective = ctx.layout, ctx.objective
    cand = load_steps(layout.case(case.name))
    out = []
    for _, ref_run in case_families(case):
        precision, control = ref_run.split("-", 1)
        ref = load_steps(layout.scores(precision, control, case.role))
        decided = replay_needed(run_decisions(objective, case.role, cand, inputs),
                                run_decisions(objective, case.role, ref, inputs), cand, ref)
        if decided is not None:
            out.append((ref_run, decided))
    return out


def judged_reads(ctx: ScoringContext, case: Case, inputs: StepInputs, verified: frozenset[str]) -> list[Path]:
    """The sealed directories judge_case reads besides the reference (which the acceptance's digest covers): the
    case, the replays on its clip decisions, and the TP1/DP1 cases it is compared with where they ran (as
    judge_case decides it: verified names cases whose seal this process has checked)."""
    from qualify.reference.forced import replay_location

    layout = ctx.layout
    reads = [layout.case(case.name)]
    reads += [replay_location(ctx, ref_run.split("-", 1)[0], case.role, decided)
              for ref_run, decided in case_replays(ctx, case, inputs)]
    reads += [layout.case(base.name) for _, base in invariance_bases(case)
              if base.name in verified or stage_is_complete(layout.case(base.name))]
    return reads


def judge_or_reuse(ctx: ScoringContext, case: Case, bounds: dict, before: dict, verified: frozenset[str],
                   inputs: StepInputs, acceptance_digest: str, log: StageLog,
                   resident: Resident | None = None) -> list[Row]:
    """judge_case, or the rows it gave before on the same evidence (qualify.candidate.judged), then kept (resident:
    as judge_case's)."""
    from qualify.candidate.judged import judged_key, load_judged, save_judged

    layout = ctx.layout
    reads = judged_reads(ctx, case, inputs, verified)
    key = judged_key(layout.root, acceptance_digest, reads)
    checked = frozenset(layout.case(n) for n in verified)
    rows = load_judged(layout.case(case.name), key, reads, checked)
    if rows is not None:
        log.note(f"judge {case.name}: {len(rows)} rows judged before on the same evidence (kept in "
                 f"{layout.case(case.name).name}.work/judged.json)")
        return rows
    from qualify.tensor_codec import CRC_SPENT

    summed = dict(CRC_SPENT)
    with log.step(f"judge {case.name}"):
        rows = judge_case(ctx, case, bounds, before, verified, inputs, resident)
    if CRC_SPENT["bytes"] > summed["bytes"]:  # where a coded case's time goes (information)
        log.note(f"  judge {case.name}: CRC of {(CRC_SPENT['bytes'] - summed['bytes']) / 1e9:.1f} GB of decoded "
                 f"tensors in {CRC_SPENT['seconds'] - summed['seconds']:.1f} s")
    save_judged(layout.case(case.name), key, rows)
    return rows


def judge_case(ctx: ScoringContext, case: Case, bounds: dict, before: dict, verified: frozenset[str] = frozenset(),
               inputs: StepInputs | None = None, resident: Resident | None = None) -> list[Row]:
    """Every step of a case against the reference's families, its evidence checks, and TPn against TP1 (verified
    names cases whose seal this process has checked since they were last written: not hashed again).

    Clip decisions are judged as decisions (qualify.candidate.decided): where the case decided a token otherwise
    than the reference, its tensors are compared with the reference replayed on its decisions. resident: the
    stage's copies on the metrics GPU (qualify.resident; one made here when not given): the case's run is moved there
    once for every comparison and derivation, each r0 and each role's fp64 start once for the stage."""
    resident = resident or Resident()
    layout, objective = ctx.layout, ctx.objective
    cand = resident.transient(load_steps(layout.case(case.name)))
    starts = params_before_steps(cand, resident.start(case.role, before))
    inputs = inputs or ctx.inputs()
    formula, truncates = declared_formula(cand[0].meta)  # its logprobs are judged against the reference's formula
    rows, own_ref = [], None
    for family, ref_run in case_families(case):
        precision, control = ref_run.split("-", 1)
        ref_dir = layout.scores(precision, control, case.role)
        r0, fam = resident.base(ref_dir, load_steps(ref_dir)), bounds[(case.role, family)]
        own_ref = r0 if own_ref is None else own_ref  # the case's own precision's r0 comes first
        comparison = f"vs ref {ref_run} [{family}]"
        ref, decided = aligned_reference(ctx, inputs, case.name, case.role, comparison, precision, cand, r0, fam)
        ref = ref if ref is r0 else resident.transient(ref)  # r0 replayed on the case's decisions: this case's alone
        judged = judge_steps(case.name, case.role, comparison, cand, formula_steps(ref, formula, truncates),
                             formula_bounds(fam, formula, truncates), starts, objective.optimizer, family=family)
        rows += explain_formula(judged, cand, ref, fam, formula) + decided
    rows += own_loss_rows(case.name, case.role, objective, cand, inputs)
    rows += derived_rows(case.name, case.role, objective, cand, inputs, scored=formula == "full" or not truncates,
                         starts=starts)
    rows += replay_rows(case.name, case.role, cand)
    rows += layout_rows(case.name, case.role, cand[0].meta)
    rows += exact_rows(case.name, case.role, cand[0].outputs, cand[0].meta, inputs.targets[0]["old_logprobs_BT"],
                       inputs.masks[0], read_json(layout.rollout(ctx.primary_tp) / "rollout.json").get("prefill_vs_decode"))
    rows += evidence_rows(case.name, case.role, cand[0].meta)
    rows += precision_rows(case.name, case.role, cand, own_ref)
    # TPn against TP1, DPn against DP1 (the same case at the lower degree) and packed against padded, when that case ran
    bitwise = cand[0].meta.get("case", {}).get("determinism") == "bitwise"
    for axis, base in invariance_bases(case):
        if not (base.name in verified or stage_is_complete(layout.case(base.name))):
            continue
        base_steps = resident.transient(load_steps(layout.case(base.name)))
        comparison = f"vs {axis} [{case.precision}-repeat]"
        fam = formula_bounds(bounds[(case.role, f"{case.precision}-repeat")], formula, truncates)
        same, mine, theirs = comparable_steps(objective, case.role, cand, base_steps, inputs)
        rows += judge_steps(case.name, case.role, comparison, cand[:same], base_steps[:same], fam, starts,
                            objective.optimizer, family=f"{case.precision}-repeat")
        if same < min(len(cand), len(base_steps)):
            rows += [replace(r, note=f"{r.note}; steps {same} to {len(cand) - 1} are not compared with {axis}: the "
                                     f"two cases decided differently at step {same}, each is compared with the "
                                     f"reference replayed on its own decisions")
                     for r in decision_rows(case.name, case.role, comparison, mine, theirs, fam, steps=same + 1)[-1:]]
        if bitwise and axis != "padded":  # the declaration is across TP x DP; packing is another layout
            rows += bitwise_rows(case.name, case.role, axis, cand, base_steps)
    if resident.device is not None:  # the case's decoded tensors held there (qualify.tensor_codec): no longer read
        release_decoded(resident.device)
    return rows


def invariance_bases(case: Case) -> list[tuple[str, Case]]:
    """('tp1', the case at TP1) when TP > 1, ('dp1', the case at DP1) when DP > 1 and ('padded', the case padded) when
    packed."""
    return [(axis, base) for axis, base in (("tp1", replace(case, tp=1)), ("dp1", replace(case, dp=1)),
                                            ("padded", replace(case, packing="padded"))) if base != case]


def case_invariance(layout: RunLayout, case: Case, rows: list[Row]) -> dict[str, Any]:
    """Per comparison with a TP1/DP1 case: each judged tensor's tier (qualify.candidate.tiers), counted."""
    out = {}
    for axis, base in invariance_bases(case):
        mine = [r for r in rows if r.case == case.name and r.comparison == f"vs {axis} [{case.precision}-repeat]"]
        if mine:
            tiers = tensor_tiers(mine, load_steps(layout.case(case.name)), load_steps(layout.case(base.name)))
            out[f"vs {axis}"] = tier_summary(tiers)
    return out


def run_candidates(matrix: Matrix, run_dir: Path, *, acceptance: Path | None = None,
                   only: str | None = None, expect: str | None = None, launches: int = 1,
                   judge_early: bool | None = None) -> Verdict:
    """Run and judge the (selected) cases; returns the verdict document. launches: how many launch groups run at
    once (each its own ranks). judge_early: judge a case as soon as its evidence (and that of the TP1/DP1 case it is
    compared with) is sealed, while other launches run; by default where the judge's metrics run on a GPU, where it
    shortens the stage. On the CPU the judge and the ranks share the cores and nothing is gained (both measured:
    benchmarks/LOG.md, "The suite and the main job at 6f7cce0"). The verdict lists the cases in matrix order whatever
    order they were judged in."""
    layout = RunLayout(Path(run_dir))
    check_engines(matrix.candidates, matrix.source)
    acc = Acceptance.load(Path(acceptance) if acceptance else layout.acceptance, layout.reference)
    if expect is not None and acc.digest != expect:  # an anchor kept outside the run (README: what it protects)
        raise EvidenceError(f"the acceptance {acc.path} has digest {acc.digest}, not the expected {expect}")
    doc, bounds = acc.document, {key: fam["bounds"] for key, fam in acc.families.items()}
    require_frozen_matrix(matrix, layout)
    acc.require_rollout(layout.rollout(matrix.rollout.vllm_tp[0]))
    cases = [c for c in matrix.cases() if only is None or fnmatch.fnmatch(c.name, only)]
    if not cases:
        raise QualifyError(f"no case matches {only!r} (cases: {', '.join(c.name for c in matrix.cases())})")
    ctx, device, log = ScoringContext.of(matrix, layout), device_of(matrix.reference), StageLog("candidate")
    models, settings = ctx.models, matrix.case_settings
    vocab = read_json(models["actor"] / "config.json")["vocab_size"]
    specs = {c: write_spec(make_spec(settings, c, model_dir=models[c.role], rollout_dir=layout.rollout(ctx.primary_tp),
                                     targets_dir=layout.targets, rollout_digest=doc["rollout_digest"],
                                     targets_digest=doc["targets_digest"], case_dir=layout.case(c.name),
                                     vocab_size=vocab, device=device), doc) for c in cases}
    groups = [list(group) for _, group in itertools.groupby(sorted(cases, key=lambda c: (c.tp, c.dp, c.engine)),
                                                            key=lambda c: (c.engine, c.tp, c.dp))]
    befores = {role: initial_parameters(path) for role, path in models.items()}
    inputs = ctx.inputs()
    resident = Resident()  # the r0 runs and fp64 starts every case is judged against, on the metrics GPU once
    judged: dict[str, list[Row]] = {}

    def judge(case: Case, verified: frozenset[str]) -> None:
        seal_replays(ctx, case, inputs, log)  # the judge's one computation, sealed before the case is judged
        judged[case.name] = judge_or_reuse(ctx, case, bounds, befores[case.role], verified, inputs, doc["digest"],
                                           log, resident)

    unsound: set[str] = set()  # marked, but its files do not match the marker: left to the end (launch_group)
    deferred: set[str] = set()  # out of GPU memory beside the launches: judged after them

    def judge_ready() -> bool:
        """Judge the first case (in matrix order) whose evidence is sealed while launches still run, with the TP1/DP1
        cases it is compared with sealed too; True when one was (or was deferred)."""
        for case in cases:
            group = [case, *(b for _, b in invariance_bases(case) if b in cases)]
            if case.name in judged or case.name in deferred or any(c.name in unsound for c in group) \
                    or not all(marked_complete(layout.case(c.name)) for c in group):
                continue
            bad = [c.name for c in group if not stage_is_complete(layout.case(c.name))]
            if bad:  # hashed once: a seal that does not hold is not hashed again at every look
                unsound.update(bad)
                continue
            if not judged_within_memory(partial(judge, case, frozenset(c.name for c in group)), resident, log,
                                        f"judge {case.name}", retry=False):
                deferred.add(case.name)
            return True
        return False

    metrics_gpu = (resident.device.index or 0) if resident.device is not None else 0
    plan = LaunchPlan(gpu_budgets(torch_gpus()) if device == "cuda" else None, judge_held=gpu_held)
    with resident.reserving(lambda: plan.reserved(metrics_gpu)):  # what the running launches may still take
        errors = run_groups(layout, groups, specs, device, log, launches,
                            judge_ready if judge_early or (judge_early is None and resident.device is not None)
                            else lambda: False, plan,
                            case_needs(models, matrix.rollout, matrix.ppo, matrix.reference) if device == "cuda"
                            else None)
    verified = frozenset(c.name for c in cases if c.name not in errors)  # launch_group checked each seal
    for case in cases:
        if case.name not in errors and case.name not in judged:
            judged_within_memory(partial(judge, case, verified), resident, log, f"judge {case.name}", retry=True)
    rows: list[Row] = []
    for case in cases:
        if case.name in errors:
            rows.append(Row(case.name, case.role, "run", "case", "exit", 1.0, 0.0, False, errors[case.name],
                            rule="the case runs to completion and seals its evidence"))
        else:
            rows += judged[case.name]
    extra = case_platforms(layout, cases, doc.get("platform"))
    for case in cases:  # the invariance tier of every tensor of a TP > 1 or DP > 1 case
        invariance = case_invariance(layout, case, rows) if case.name not in errors else {}
        if invariance:
            extra.setdefault(case.name, {})["invariance"] = invariance
    verdict = verdict_document(matrix.name, doc, cases, rows, complete=only is None, platforms=extra)
    write_json(layout.verdict if only is None else layout.selection_verdict(selection_name(only)),
               verdict.to_json())
    return verdict


def selection_name(only: str) -> str:
    """A file-name-safe label for a --only glob, unique per glob (the sanitized text alone can collide)."""
    import hashlib

    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in only)
    return f"{safe}-{hashlib.sha256(only.encode()).hexdigest()[:8]}"


def case_platforms(layout: RunLayout, cases: list[Case], reference_platform: dict[str, Any] | None) -> dict[str, Any]:
    """Per case: its platform and how it differs from the reference's (information: a verdict never fails on it)."""
    from qualify.hardware import describe, platform_differences

    out = {}
    for case in cases:
        meta = layout.case(case.name) / "meta.json"
        platform = read_json(meta).get("platform") if meta.is_file() else None
        if platform is not None:
            out[case.name] = {"platform": describe(platform),
                              "differs_from_reference": platform_differences(reference_platform, platform)}
    return out


def verdict_document(matrix_name: str, doc: dict[str, Any], cases: list[Case], rows: list[Row],
                     complete: bool, platforms: dict[str, Any] | None = None) -> Verdict:
    """The verdict: per case, every row, and the platforms (a case run elsewhere than its reference says so)."""
    from qualify.hardware import describe

    return make_verdict(VERDICT_SCHEMA, matrix_name, rows, [c.name for c in cases], extra=platforms, details={
        "acceptance_digest": doc["digest"], "rollout_digest": doc["rollout_digest"], "complete": complete,
        "reference_platform": describe(doc.get("platform"))})