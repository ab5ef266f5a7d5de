"""`qualify candidate`: verify the acceptance, run every case on the frozen rollout, judge, write the verdict.

The stage's body is its named steps: plan (the selected cases' specs, with their resume keys, and their launch
groups) -> launch (qualify.candidate.launches.Scheduler; a case judged as soon as it is sealed where the judge's
metrics run on a GPU) -> seal replays (the reference replayed on a case's clip decisions) -> judge
(qualify.judge.case.judge_case, or the rows judged before on the same evidence) -> write the verdict.

The cases sharing engine, TP and DP run as one launch of tp x dp ranks (qualify.case.launch: started directly with
torchrun's rank variables, or forked from a warm server on the CPU; under Slurm the job's one srun task is this
stage, which starts them the same way), so no engine's global state leaks into another engine's. Cases whose evidence
is complete and verified are skipped (resume: qualify.candidate.resume); a case that crashes is a failed case with its
log tail in the verdict, not a crash of the whole stage.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qualify.acceptance import Acceptance
from qualify.candidate.launches import Scheduler
from qualify.candidate.plugin_static import require_static_contract
from qualify.candidate.resume import write_spec
from qualify.candidate.schedule import LaunchPlan, case_needs, gpu_budgets, gpu_held, torch_gpus
from qualify.case.meta import NAME as META_NAME
from qualify.case.meta import read_case_meta
from qualify.case.ranks import device_of
from qualify.case.spec import make_spec
from qualify.engines.registry import require_engine
from qualify.errors import EvidenceError, QualifyError
from qualify.judge.case import case_invariance, case_replays, judge_case, judged_reads
from qualify.judge.decided import StepInputs
from qualify.layout import RunLayout
from qualify.matrix import Candidates, Case, CaseSettings, Matrix, Objective
from qualify.models.checkpoint import initial_parameters
from qualify.reference.context import ScoringContext
from qualify.resident import Resident
from qualify.runname import RunName
from qualify.stagelog import StageLog
from qualify.stages import stage_is_complete
from qualify.store import read_json, write_json
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


def check_engines(candidates: Candidates, objective: Objective, cases: list[Case], source: str) -> None:
    """Every engine the candidates section names is one the registry can build, and no plugin's source shows it
    breaking the contract for the cases that run (qualify.candidate.plugin_static; source: the matrix file)."""
    for name in candidates.engines:
        require_engine(name, where=f" in {source}")
        require_static_contract(name, cases, objective, where=f" in {source}")


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
    check_engines(matrix.candidates, matrix.objective, matching_cases(matrix.cases(), only), matrix.source)
    acc = pinned_acceptance(layout, acceptance, expect)
    require_frozen_matrix(matrix, layout)
    acc.require_rollout(layout.rollout(matrix.rollout.vllm_tp[0]))
    doc, bounds = acc.document, {key: fam["bounds"] for key, fam in acc.families.items()}
    cases = selected_cases(matrix.cases(), only)
    ctx, device, log = ScoringContext.of(matrix, layout), device_of(matrix.reference), StageLog("candidate")
    specs, groups = plan_cases(matrix.case_settings, ctx, cases, doc, device)
    befores = {role: initial_parameters(path) for role, path in ctx.models.items()}
    inputs = ctx.inputs()
    resident = Resident()  # the r0 runs and fp64 starts every case is judged against, on the metrics GPU once

    def judge(case: Case, verified: frozenset[str]) -> list[Row]:
        seal_replays(ctx, case, inputs, log)  # the judge's one computation, sealed before the case is judged
        return judge_or_reuse(ctx, case, bounds, befores[case.role], verified, inputs, doc["digest"], log, resident)

    scheduler = Scheduler(layout, cases, specs, device, log, judge, resident,
                          LaunchPlan(gpu_budgets(torch_gpus()) if device == "cuda" else None, judge_held=gpu_held),
                          case_needs(ctx.models, matrix.rollout, matrix.ppo, matrix.reference) if device == "cuda"
                          else None)
    errors = launch_cases(scheduler, resident, groups, launches, judge_early)
    scheduler.judge_rest(errors)
    return write_verdict(matrix.name, layout, doc, cases, scheduler.rows, errors, only)


def pinned_acceptance(layout: RunLayout, acceptance: Path | None, expect: str | None) -> Acceptance:
    """The acceptance (the run's, or the file given), verified, and its digest the expected one when given."""
    acc = Acceptance.load(Path(acceptance) if acceptance else layout.acceptance, layout.reference)
    if expect is not None and acc.digest != expect:  # an anchor kept outside the run (README: "What the digests protect against")
        raise EvidenceError(f"the acceptance {acc.path} has digest {acc.digest}, not the expected {expect}")
    return acc


def matching_cases(all_cases: list[Case], only: str | None) -> list[Case]:
    """The matrix's cases, those matching the --only glob when given."""
    return [c for c in all_cases if only is None or fnmatch.fnmatch(c.name, only)]


def selected_cases(all_cases: list[Case], only: str | None) -> list[Case]:
    """The matrix's cases, those matching the --only glob when given; none is an error naming the cases."""
    cases = matching_cases(all_cases, only)
    if not cases:
        raise QualifyError(f"no case matches {only!r} (cases: {', '.join(c.name for c in all_cases)})")
    return cases


def plan_cases(settings: CaseSettings, ctx: ScoringContext, cases: list[Case], doc: dict[str, Any],
               device: str) -> tuple[dict[Case, Path], list[list[Case]]]:
    """Plan: each case's spec file (with its resume key), and the launch groups (the cases sharing engine, TP and
    DP)."""
    layout, models = ctx.layout, ctx.models
    vocab = read_json(models["actor"] / "config.json")["vocab_size"]
    specs = {c: write_spec(make_spec(settings, c, model_dir=models[c.role],
                                     rollout_dir=layout.rollout(ctx.primary_tp), targets_dir=layout.targets,
                                     rollout_digest=doc["rollout_digest"], targets_digest=doc["targets_digest"],
                                     case_dir=layout.case(c.name), vocab_size=vocab, device=device), doc)
             for c in cases}
    groups = [list(group) for _, group in itertools.groupby(sorted(cases, key=lambda c: (c.tp, c.dp, c.engine)),
                                                            key=lambda c: (c.engine, c.tp, c.dp))]
    return specs, groups


def launch_cases(scheduler: Scheduler, resident: Resident, groups: list[list[Case]], launches: int,
                 judge_early: bool | None) -> dict[str, str]:
    """Launch: the groups, launches at once, judging what is sealed meanwhile where judge_early (by default where the
    judge's metrics run on a GPU); the judge's GPU copies leave the running launches what they may still take.
    Returns errors by case name."""
    metrics_gpu = (resident.device.index or 0) if resident.device is not None else 0
    early = bool(judge_early or (judge_early is None and resident.device is not None))
    with resident.reserving(lambda: scheduler.plan.reserved(metrics_gpu)):  # what the running launches may take
        return scheduler.run(groups, launches, early)


def seal_replays(ctx: ScoringContext, case: Case, inputs: StepInputs, log: StageLog) -> None:
    """Seal replays: the judge's one computation, made and sealed before any judging: for each reference run the case
    is compared with, that run replayed on the case's clip decisions where they differ from the run's
    (qualify.reference.forced; cases that decided alike share one). The judge, and `qualify report` judging again,
    only read it."""
    from qualify.reference.forced import ensure_replay, replay_location

    for ref_run, decided in case_replays(ctx, case, inputs):
        precision = RunName.parse(ref_run).precision
        if stage_is_complete(replay_location(ctx, precision, case.role, decided)):
            continue
        with log.step(f"replay {ref_run} {case.role} on {case.name}'s clip decisions"):
            ensure_replay(ctx, precision, case.role, decided)


def judge_or_reuse(ctx: ScoringContext, case: Case, bounds: dict, before: dict, verified: frozenset[str],
                   inputs: StepInputs, acceptance_digest: str, log: StageLog,
                   resident: Resident | None = None) -> list[Row]:
    """Judge: judge_case, or the rows it gave before on the same evidence (qualify.judge.judged), then kept
    (resident: as judge_case's)."""
    from qualify.judge.judged import judged_key, load_judged, save_judged

    layout = ctx.layout
    reads = judged_reads(ctx, case, inputs, verified)
    key = judged_key(layout.root, acceptance_digest, reads)
    checked = frozenset(layout.case(n) for n in verified)
    rows = load_judged(layout.case(case.name), key, reads, checked)
    if rows is not None:
        log.note(f"judge {case.name}: {len(rows)} rows judged before on the same evidence (kept in "
                 f"{layout.case(case.name).name}.work/judged.json)")
        return rows
    with _crc_note(log, case.name), log.step(f"judge {case.name}"):
        rows = judge_case(ctx, case, bounds, before, verified, inputs, resident)
    save_judged(layout.case(case.name), key, rows)
    return rows


@contextlib.contextmanager
def _crc_note(log: StageLog, name: str) -> Iterator[None]:
    """Where a coded case's judging time goes (information): the CRC the block spent checking decoded tensors
    (a qualify.tensor_codec meter open around it), noted after it."""
    from qualify.tensor_codec import metering

    with metering() as spent:
        yield
    if spent.bytes:
        log.note(f"  judge {name}: CRC of {spent.bytes / 1e9:.1f} GB of decoded tensors in {spent.seconds:.1f} s")


def write_verdict(matrix_name: str, layout: RunLayout, doc: dict[str, Any], cases: list[Case],
                  judged: dict[str, list[Row]], errors: dict[str, str], only: str | None) -> Verdict:
    """Write the verdict: every case's rows in matrix order (a case that did not run: one failing row with its log's
    tail), the platforms, the invariance tier of every tensor of a TP > 1 or DP > 1 case; the full run's verdict, or
    the --only selection's."""
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
    verdict = verdict_document(matrix_name, doc, cases, rows, complete=only is None, platforms=extra)
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
        found = (layout.case(case.name) / META_NAME).is_file()
        platform = read_case_meta(layout.case(case.name)).platform if found else None
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