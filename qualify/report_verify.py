"""What `qualify report` verifies before it may say PASSED: the acceptance, the verdict, the evidence.

The acceptance is checked against the reference evidence (manifest digests, bound-file digests, the
rule); the candidates' verdict against the acceptance (same acceptance and rollout digests, a
non-empty and complete set of cases, pass flags that follow from value and bound) and against each
case's sealed evidence (complete per qualify.stages, made on the frozen rollout, and judged again
from that evidence it gives the verdict's rows: same checks, bounds, values and outcomes). Rounds
verdicts must be sealed and agree with their own rows. A problem is a one-line string; none means
the summary may be believed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError, QualifyError
from qualify.layout import WORK_SUFFIX, RunLayout
from qualify.matrix import CASE_NAME, parse_case_name
from qualify.stages import Sealed, check_sealed_all, stage_is_complete
from qualify.verdict import VERDICT_SCHEMA

ROW_KEYS = ("case", "role", "comparison", "tensor", "metric", "value", "bound", "passed")
REL_TOL = 1e-9  # judged again in the same float64 arithmetic; only the JSON round trip may differ
MAX_LISTED = 5


@dataclass(frozen=True, slots=True)
class Verification:
    """Outcome of verifying a run directory: what was checked, and every problem found."""

    checked: tuple[str, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "checked": list(self.checked), "problems": list(self.problems)}


def listed(items: list[str]) -> str:
    """The first MAX_LISTED items, comma-separated, with how many more."""
    return ", ".join(items[:MAX_LISTED]) + (f" (+{len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else "")


def number(v: Any) -> float:
    """A verdict number: floats, or 'inf'/'nan' strings for non-finite values."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise TypeError(f"not a number: {v!r}")
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"not a number: {v!r}") from None


def acceptance_problems(layout: RunLayout, reference: dict[str, Any], acceptance: dict[str, Any] | None) -> list[str]:
    """The acceptance is sound and the reference evidence is exactly what it sealed."""
    from qualify.acceptance import check_acceptance
    from qualify.manifest import verify_manifest

    if acceptance is None:
        return [f"no acceptance at {layout.acceptance}: nothing was frozen, so no verdict can be believed"]
    try:
        problems = [f"acceptance: {p}" for p in check_acceptance(layout.acceptance)]
        report = verify_manifest(layout.acceptance, layout.reference, progress=False)
    except QualifyError as exc:
        return [f"acceptance: {exc}"]
    for kind, paths in (("missing", report.missing), ("extra", report.extra),
                        ("modified", [m.path for m in report.modified])):
        if paths:
            problems.append(f"reference evidence {kind} against the acceptance: {listed(paths)}")
    if acceptance.get("rollout_digest") != reference.get("rollout_digest"):
        problems.append("the acceptance's rollout digest is not the reference's")
    from qualify.acceptance import chain_problems

    return problems + chain_problems(layout.acceptance, acceptance, layout.reference)


def row_problems(row: Any, index: int, cases: dict[str, Any]) -> list[str]:
    """One verdict row: its fields are there, it names a listed case, its outcome follows from value and bound."""
    if not isinstance(row, dict) or any(k not in row for k in ROW_KEYS):
        return [f"verdict row {index} lacks one of {', '.join(ROW_KEYS)}"]
    if not all(isinstance(row[k], str) for k in ("case", "role", "comparison", "tensor", "metric")):
        return [f"verdict row {index}: case, role, comparison, tensor and metric must be strings"]
    if row["case"] not in cases:
        return [f"verdict row {index} names case {row['case']!r}, which the verdict does not list"]
    try:
        value, bound = number(row["value"]), number(row["bound"])
    except (TypeError, ValueError) as exc:
        return [f"verdict row {index}: {exc}"]
    if row["passed"] is not (math.isfinite(value) and value <= bound):
        return [(f"verdict row {index} ({row['case']} {row['tensor']} {row['metric']}): passed={row['passed']} "
                 f"does not follow from value {value} and bound {bound}")]
    if row["comparison"] == "run" and row["passed"] is not False:
        return [(f"verdict row {index} ({row['case']}): a case that did not run cannot pass (a 'run' row is its "
                "failure, never a result)")]
    return []


def case_problems(name: str, summary: Any, rows: list[dict[str, Any]]) -> list[str]:
    """A case's summary agrees with its rows."""
    if not CASE_NAME.match(name):
        return [f"verdict case {name!r} is not an <engine>-<precision>-tp<N>[-dp<M>][-packed]-<role> name"]
    num_failed = sum(not r["passed"] for r in rows)
    if (summary["passed"] is not (bool(rows) and num_failed == 0) or summary["num_checks"] != len(rows)
            or summary["num_failed"] != num_failed):
        return [(f"verdict case {name}: summary (passed={summary['passed']}, {summary['num_checks']} checks, "
                 f"{summary['num_failed']} failed) disagrees with its {len(rows)} rows ({num_failed} failed)")]
    return []


def readable(verdict: Any) -> bool:
    """The verdict has the shape a summary reads: cases with their summaries, rows, a pass flag."""
    return (isinstance(verdict, dict) and isinstance(verdict.get("rows"), list)
            and isinstance(verdict.get("passed"), bool) and isinstance(verdict.get("cases"), dict)
            and all(isinstance(c, dict) and {"passed", "num_checks", "num_failed"} <= c.keys()
                    for c in verdict["cases"].values()))


def verdict_problems(verdict: Any, acceptance: dict[str, Any] | None) -> list[str]:
    """The verdict's own consistency and its ties to the acceptance (no evidence read)."""
    if not readable(verdict):
        return ["verdict: not a qualify verdict (needs 'passed', 'rows' and 'cases' with their summaries)"]
    problems = []
    if verdict.get("schema") != VERDICT_SCHEMA:
        problems.append(f"verdict: schema {verdict.get('schema')!r} != {VERDICT_SCHEMA!r}")
    if acceptance is not None:
        for key in ("acceptance_digest", "rollout_digest"):
            want = acceptance.get("digest" if key == "acceptance_digest" else key)
            if verdict.get(key) != want:
                problems.append(f"verdict: {key} {verdict.get(key)!r} is not the acceptance's {want!r}")
    if not verdict["cases"]:
        problems.append("verdict: names no case")
    if verdict.get("complete") is not True:
        problems.append("verdict: not complete (a --only selection is not a qualification)")
    for i, row in enumerate(verdict["rows"]):
        problems += row_problems(row, i, verdict["cases"])
    if problems:
        return problems
    for name, summary in verdict["cases"].items():
        problems += case_problems(name, summary, [r for r in verdict["rows"] if r["case"] == name])
    cases_passed = all(c["passed"] is True for c in verdict["cases"].values())
    if verdict["passed"] is not (cases_passed and bool(verdict["cases"])):
        problems.append(f"verdict: passed={verdict.get('passed')} disagrees with its cases")
    return problems


def link_problems(layout: RunLayout) -> list[str]:
    """Every symlink in the run's evidence (reference/, acceptance/, candidates/, rounds/; not the .work/ scratch
    beside a stage): a directory linked to another run's (a case, a rounds run) is refused as a linked file is, never
    followed and believed."""
    out, pending = [], []
    for top in (layout.reference, layout.acceptance_dir, layout.candidates, layout.rounds):
        if top.is_symlink():
            out.append(f"refusing symlinked directory in evidence: {top}")
        elif top.is_dir():
            pending.append(top)
    while pending:
        try:
            with os.scandir(pending.pop()) as it:
                entries = list(it)
        except OSError as exc:
            out.append(f"cannot list {exc.filename}: {exc.strerror}")
            continue
        for entry in entries:
            if entry.name.endswith(WORK_SUFFIX):
                continue
            if entry.is_symlink():
                kind = "symlinked directory" if os.path.isdir(entry.path) else "symlink"
                out.append(f"refusing {kind} in evidence: {entry.path} -> {os.readlink(entry.path)}")
            elif entry.is_dir(follow_symlinks=False):
                pending.append(Path(entry.path))
    return sorted(out)


def sealed_cases(layout: RunLayout) -> dict[str, Sealed]:
    """Every case directory of the run whose seal verifies, by case name (hashed in one parallel pass: what
    case_set_problems and evidence_problems are given, so no case is hashed twice)."""
    if not layout.candidates.is_dir():
        return {}
    found = check_sealed_all(p for p in layout.candidates.iterdir() if layout.is_case_dir(p))
    return {path.name: s for path, s in found.items() if s is not None}


def started_cases(layout: RunLayout) -> list[str]:
    """Every case a candidate stage started in the run, sorted: its evidence directory (sealed or partial) or only
    its .work/ (the stage writes every selected case's spec there before it launches any)."""
    if not layout.candidates.is_dir():
        return []
    names = {p.name.removesuffix(WORK_SUFFIX) for p in layout.candidates.iterdir() if p.is_dir()}
    return sorted(n for n in names if CASE_NAME.match(n))


def case_set_problems(layout: RunLayout, verdict: dict[str, Any], cases: dict[str, Sealed] | None = None) -> list[str]:
    """The verdict judges every case whose sealed evidence is in the run: a case is never left out of it (the
    candidates section may change after freeze, so the frozen matrix does not fix the set; the evidence does), and a
    case started but never sealed is a candidate stage that did not finish (the verdict is an older one).
    cases: sealed_cases(layout), when the caller has it."""
    if not layout.candidates.is_dir():
        return []
    sealed = sorted(sealed_cases(layout) if cases is None else cases)
    lacking = [name for name in sealed if name not in verdict["cases"]]
    if lacking:
        return [(f"verdict: leaves out {len(lacking)} case(s) whose sealed evidence is in {layout.candidates} "
                 f"({listed(lacking)}): every case that ran is judged")]
    unfinished = [name for name in started_cases(layout) if name not in verdict["cases"]]
    if unfinished:
        return [(f"candidate stage did not finish: cases missing from the verdict: {listed(unfinished)} (started "
                 f"in {layout.candidates}, never sealed; the verdict is from an earlier candidate stage)")]
    return []


def load_bounds(layout: RunLayout, acceptance: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """The frozen bounds by (role, family), from the bound files the acceptance names (each checked by digest)."""
    from qualify.bounds.files import read_bound_files

    return {key: d["bounds"] for key, d in read_bound_files(layout.acceptance_dir, acceptance["bounds"]).items()}


def sealed_problems(layout: RunLayout, acceptance: dict[str, Any], names: list[str],
                    cases: dict[str, Sealed] | None = None) -> list[str]:
    """Each named case's evidence is complete, verified and was made on the frozen rollout (cases:
    sealed_cases(layout), when the caller has it)."""
    problems = []
    cases = sealed_cases(layout) if cases is None else cases
    for name in names:
        where = layout.case(name)
        if name not in cases or cases[name].path != where:
            problems.append(f"case {name}: evidence at {where} is missing, partial or modified since it was sealed")
            continue
        info = cases[name].info
        if info.get("case") != name or info.get("rollout_digest") != acceptance["rollout_digest"]:
            problems.append(f"case {name}: evidence at {where} was sealed for {info.get('case')!r} on rollout "
                            f"{info.get('rollout_digest')!r}, not for this case on the frozen rollout")
            continue
        problems += spec_problems(name, where)
    return problems


def spec_problems(name: str, where: Path) -> list[str]:
    """The case's sealed meta.json (its digest is in the seal) records the spec the evidence was made from: the case
    that spec names (engine, precision, TP, DP, packing, role) must be this one (another case's evidence copied over it is
    not)."""
    from qualify.case.meta import read_case_meta
    from qualify.matrix import Case

    try:
        spec = read_case_meta(where).spec
        made = Case(engine=spec["engine"], precision=spec["precision"], tp=int(spec["tp"]), role=spec["role"],
                    dp=int(spec.get("dp", 1)), packing=spec.get("packing", "padded"))
    except (QualifyError, AttributeError, KeyError, TypeError, ValueError):
        return [f"case {name}: its sealed meta.json does not record the spec it was run from"]
    if made.name != name or spec.get("name") != name:
        return [(f"case {name}: its evidence was made from the spec of {spec.get('name')!r} ({made.engine}, "
                f"{made.precision}, TP{made.tp}, DP{made.dp}, {made.role}), not this case's")]
    return []


def _same_number(a: Any, b: Any) -> bool:
    x, y = number(a), number(b)
    return (math.isnan(x) and math.isnan(y)) or x == y or math.isclose(x, y, rel_tol=REL_TOL, abs_tol=0.0)


def _row_key(row: dict[str, Any]) -> tuple[str, str, str, str]:
    return row["comparison"], row["tensor"], row["metric"], row.get("note", "")


def compare_rows(name: str, judged: list[dict[str, Any]], recorded: list[dict[str, Any]]) -> list[str]:
    """The rows judged again from the evidence against the verdict's rows of one case."""
    mine = {_row_key(r): r for r in judged}
    theirs = {_row_key(r): r for r in recorded}
    problems = []
    lacking = [" ".join(k[:3]) for k in mine.keys() - theirs.keys()]
    surplus = [" ".join(k[:3]) for k in theirs.keys() - mine.keys()]
    if lacking:
        problems.append(f"case {name}: the verdict lacks checks its evidence gives: {listed(sorted(lacking))}")
    if surplus:
        problems.append(f"case {name}: the verdict has checks its evidence does not give: {listed(sorted(surplus))}")
    differ = [" ".join(k[:3]) for k in sorted(mine.keys() & theirs.keys())
              if mine[k]["passed"] != theirs[k]["passed"] or not _same_number(mine[k]["value"], theirs[k]["value"])
              or not _same_number(mine[k]["bound"], theirs[k]["bound"]) or mine[k].get("step") != theirs[k].get("step")]
    if differ:
        # the step too: the reports read it as the row's step (qualify.verdict.Row.step), not from the tensor's name
        problems.append(f"case {name}: value, bound, step or outcome differs from what its evidence gives: "
                        f"{listed(differ)}")
    return problems


def rejudge_problems(layout: RunLayout, reference: dict[str, Any], acceptance: dict[str, Any],
                     verdict: dict[str, Any], names: list[str]) -> list[str]:
    """Judge every named case again from its sealed evidence and compare with the verdict's rows."""
    from qualify.judge.case import judge_case
    from qualify.matrix import Matrix
    from qualify.models.checkpoint import initial_parameters
    from qualify.reference.context import ScoringContext
    from qualify.resident import Resident
    from qualify.schema import from_dict

    matrix = from_dict(Matrix, reference["matrix"], str(layout.reference_summary))
    ctx = ScoringContext.of(matrix, layout, reference["rollout_digest"], reference["targets_digest"])
    bounds, models = load_bounds(layout, acceptance), ctx.models
    befores: dict[str, Any] = {}
    resident = Resident()  # the r0 runs and fp64 starts every case is judged against, on the metrics GPU once
    problems = []
    for name in names:
        case = parse_case_name(name)
        assert case is not None  # checked by case_problems
        if case.role not in befores:
            befores[case.role] = initial_parameters(models[case.role])
        try:
            judged = [r.to_json() for r in judge_case(ctx, case, bounds, befores[case.role], frozenset(names),
                                                      resident=resident)]  # sealed_problems verified each named case
        except EvidenceError as exc:  # a replay the judge reads is not sealed: nothing is computed here
            problems.append(f"{name}: cannot be judged again: {exc}")
            continue
        problems += compare_rows(name, judged, [r for r in verdict["rows"] if r["case"] == name])
    return problems


def evidence_problems(layout: RunLayout, reference: dict[str, Any], acceptance: dict[str, Any],
                      verdict: dict[str, Any], cases: dict[str, Sealed] | None = None) -> list[str]:
    """Every case that ran: sealed evidence, and the verdict's rows are what that evidence gives (cases:
    sealed_cases(layout), when the caller has it)."""
    cases = sealed_cases(layout) if cases is None else cases
    # a case that did not run has no evidence to judge again: its one row fails it. A case whose evidence is sealed
    # ran, whatever its rows say, and is judged again like any other
    did_not_run = {r["case"] for r in verdict["rows"] if r["comparison"] == "run"
                   and not (r["case"] in cases and cases[r["case"]].path == layout.case(r["case"]))}
    names = [n for n in verdict["cases"] if n not in did_not_run]
    problems = sealed_problems(layout, acceptance, names, cases)
    if problems or not names:
        return problems
    try:
        return rejudge_problems(layout, reference, acceptance, verdict, names)
    except QualifyError as exc:
        return [f"candidate evidence cannot be judged again: {exc}"]


def frozen_rounds_bound(layout: RunLayout, reference: dict[str, Any], acceptance: dict[str, Any] | None
                        ) -> float | None:
    """The logprob bound a rounds run must have used: the acceptance's rule (k, logprob floor) applied to the
    reference's vLLM-vs-HF control in the rollout's precision (qualify.rounds.base.reference_control); None without
    a readable acceptance."""
    from qualify.bounds.rule import logprob_bound, logprob_rule
    from qualify.rounds.base import reference_control

    try:
        k, floor = logprob_rule(acceptance["rule"])
        control, _ = reference_control(reference, layout.rollout(int(reference.get("primary_vllm_tp", 1))))
        return logprob_bound(control, k, floor)
    except (KeyError, TypeError, ValueError, QualifyError):
        return None


def frozen_rounds_asked(reference: dict[str, Any]) -> int | None:
    """The rounds the frozen matrix asks for (its rounds.rounds, in the reference summary's snapshot); None where the
    snapshot does not say."""
    section = (reference.get("matrix") or {}).get("rounds")
    asked = section.get("rounds") if isinstance(section, dict) else None
    return asked if isinstance(asked, int) and not isinstance(asked, bool) else None


def rounds_problems(layout: RunLayout, tp: int, doc: Any, acceptance: dict[str, Any] | None = None,
                    bound: float | None = None, asked: int | None = None) -> list[str]:
    """A rounds verdict is sealed, its pass flag follows from its rows, it ran on the frozen acceptance, and every
    row, and the number of rounds it claims, is what its sealed evidence gives (qualify.rounds.rederive; asked: the
    rounds the frozen matrix asks for)."""
    from qualify.rounds.rederive import rederive_problems

    where = layout.rounds_dir(tp)
    if not stage_is_complete(where):
        return [f"rounds vllm-tp{tp}: {where} is missing, partial or modified since it was sealed"]
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("passed"), bool) for r in rows):
        return [f"rounds vllm-tp{tp}: verdict has no readable rows"]
    if doc.get("passed") is not (bool(rows) and all(r["passed"] for r in rows) and doc.get("failure") is None):
        return [f"rounds vllm-tp{tp}: passed={doc.get('passed')} disagrees with its rows and failure"]
    if acceptance is None:
        return []  # the acceptance's own absence is the problem (acceptance_problems)
    used = (doc.get("bound") or {}).get("acceptance_digest") if isinstance(doc.get("bound"), dict) else None
    if used != acceptance.get("digest"):
        return [(f"rounds vllm-tp{tp}: ran on acceptance {used}, not on the frozen {acceptance.get('digest')} (its "
                 "logprob bound is not the frozen one)")]
    return [f"rounds vllm-tp{tp}: {p}" for p in rederive_problems(where, doc, bound, asked)]


def verify_run(layout: RunLayout, reference: dict[str, Any], acceptance: dict[str, Any] | None,
               verdict: Any, rounds: dict[int, Any], expect: str | None = None) -> Verification:
    """Everything a report summarizes, verified; an acceptance is required once anything claims a result (expect:
    the acceptance's digest as pinned outside the run)."""
    checked: list[str] = []
    problems: list[str] = []
    if expect is not None:
        checked.append(f"the acceptance's digest is the expected {expect}")
        got = (acceptance or {}).get("digest")
        if got != expect:
            problems.append(f"the acceptance's digest {got} is not the expected {expect}")
    checked.append("no symlink in the run's evidence")
    problems += link_problems(layout)
    claims = verdict is not None or bool(rounds)
    if acceptance is not None or claims:
        checked.append("acceptance and bound files against the reference evidence")
        problems += acceptance_problems(layout, reference, acceptance)
    if verdict is not None:
        checked.append("verdict against the acceptance and the cases that ran")
        own = verdict_problems(verdict, acceptance)
        try:
            cases = sealed_cases(layout) if not own and acceptance is not None else None
        except QualifyError as exc:  # a symlinked case directory (link_problems names it too)
            cases, own = None, [str(exc)]
        if cases is not None:
            own = case_set_problems(layout, verdict, cases)
        problems += own
        if not problems:
            checked.append("every case judged again from its sealed evidence")
            problems += evidence_problems(layout, reference, acceptance, verdict, cases)
    bound = frozen_rounds_bound(layout, reference, acceptance) if rounds else None
    for tp, doc in sorted(rounds.items()):
        checked.append(f"rounds vllm-tp{tp} sealed and judged again from its sealed evidence")
        try:
            problems += rounds_problems(layout, tp, doc, acceptance, bound, frozen_rounds_asked(reference))
        except QualifyError as exc:  # a symlinked rounds directory (link_problems names it too)
            problems.append(f"rounds vllm-tp{tp}: {exc}")
    return Verification(tuple(checked), tuple(problems))


def discover_rounds(layout: RunLayout) -> dict[int, Path]:
    """rounds/vllm-tp<N>/verdict.json of every rounds run present, by TP degree."""
    found = {}
    for path in sorted(layout.rounds.glob("vllm-tp*/verdict.json")):
        tp = path.parent.name.removeprefix("vllm-tp")
        if tp.isdigit() and layout.rounds_dir(int(tp)) == path.parent:
            found[int(tp)] = path
    return found
