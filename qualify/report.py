"""Summary of a run directory: reference, acceptance, candidate verdict and rounds, verified, as plain data.

Nothing is summarized as PASSED unless it verifies (qualify.report_verify): the status is PASSED or
FAILED only for a verified verdict, NOT VERIFIED otherwise, and NO VERDICT for a run whose candidate
stage never finished. Only PASSED exits 0: a report of a qualification that has not happened (no
acceptance, no verdict, cases started but missing from the verdict) names the stage that did not
finish and fails. The CLI renders the summary as a terminal summary, Markdown, JSON, HTML
(qualify.report_html) or JUnit XML (qualify.junit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError
from qualify.hardware import describe
from qualify.layout import RunLayout
from qualify.reference.mismatch_text import evidence_line, mismatch_lines, routing_lines
from qualify.report_verify import (
    CASE_NAME,
    Verification,
    discover_rounds,
    listed,
    readable,
    started_cases,
    verify_run,
)
from qualify.store import read_json, read_json_object, tree_bytes
from qualify.waivers import waiver_text, waivers_of

PASSED, FAILED, NOT_VERIFIED, NO_VERDICT = "PASSED", "FAILED", "NOT VERIFIED", "NO VERDICT"
WORST_KEYS = ("comparison", "tensor", "metric", "value", "bound", "ratio")


@dataclass(frozen=True, slots=True)
class RunDocs:
    """The documents of a run directory, as read (nothing verified yet)."""

    layout: RunLayout
    reference: dict[str, Any]
    acceptance: dict[str, Any] | None
    verdict: Any
    rounds: dict[int, Any]


def _maybe(path: Path) -> Any:
    return read_json(path) if path.is_file() else None


def load_docs(run_dir: Path) -> RunDocs:
    """Read the reference summary, acceptance, candidates' verdict and rounds verdicts of a run."""
    layout = RunLayout(Path(run_dir))
    if not layout.reference_summary.is_file():
        raise EvidenceError(f"{run_dir} holds no reference summary ({layout.reference_summary})")
    reference = read_json_object(layout.reference_summary, "reference summary",
                                 ("matrix", "rollout_digest", "tp_agreement", "rollout_mismatch", "controls"))
    if not isinstance(reference["matrix"], dict) or "name" not in reference["matrix"]:
        raise EvidenceError(f"{layout.reference_summary}: not a reference summary: 'matrix' has no name")
    acceptance = _maybe(layout.acceptance)
    if acceptance is not None and not isinstance(acceptance, dict):
        raise EvidenceError(f"{layout.acceptance}: not an acceptance document")
    rounds = {tp: read_json(path) for tp, path in discover_rounds(layout).items()}
    return RunDocs(layout, reference, acceptance, _maybe(layout.verdict), rounds)


def status_of(verification: Verification, verdict: Any, rounds: dict[int, Any]) -> str:
    """PASSED or FAILED only for verified evidence; NOT VERIFIED when anything does not verify."""
    if not verification.ok:
        return NOT_VERIFIED
    rounds_ok = all(doc["passed"] for doc in rounds.values())
    if verdict is None:
        return NO_VERDICT if rounds_ok else FAILED
    return PASSED if verdict["passed"] and rounds_ok else FAILED


def unfinished_stages(docs: RunDocs) -> list[dict[str, str]]:
    """The stages of the run that did not finish, each {'stage', 'reason'}: freeze without an acceptance, the
    candidate stage without a verdict or with cases it started missing from its verdict. A report of such a run is
    no pass, whatever verifies."""
    out = []
    if docs.acceptance is None:
        out.append({"stage": "freeze", "reason": "no acceptance"})
    started = started_cases(docs.layout)
    if docs.verdict is None:
        out.append({"stage": "candidate", "reason": "no verdict" + (f" (cases started: {listed(started)})"
                                                                   if started else "")})
    elif readable(docs.verdict):
        missing = [name for name in started if name not in docs.verdict["cases"]]
        if missing:
            out.append({"stage": "candidate", "reason": f"cases missing from the verdict: {listed(missing)}"})
    return out


def unfinished_line(entry: dict[str, str]) -> str:
    """'candidate stage did not finish: no verdict'."""
    return f"{entry['stage']} stage did not finish: {entry['reason']}"


def case_axes(name: str) -> dict[str, Any]:
    """engine, precision, tp and role of a case name (empty for a name that is not one), and its packing where the
    name says packed."""
    m = CASE_NAME.match(name)
    if m is None:
        return {}
    packed = {"packing": m["packing"]} if m["packing"] else {}
    return {"engine": m["engine"], "precision": m["precision"], "tp": int(m["tp"]), "role": m["role"]} | packed


def _case_summary(name: str, c: dict[str, Any]) -> dict[str, Any]:
    worst = c.get("worst")
    return {**case_axes(name), "passed": c["passed"], "num_checks": c["num_checks"], "num_failed": c["num_failed"],
            "worst": {k: worst.get(k) for k in WORST_KEYS} if isinstance(worst, dict) else None}


def closest_passing(rows: list[dict[str, Any]], derived: bool = False) -> dict[str, Any] | None:
    """The passing row nearest its bound (largest value/bound among rows with a positive bound): the false-alarm
    margin of a verdict, what a correct engine leaves between itself and a FAIL. Bound rows (k x control error +
    floor + quantum) by default; derived=True: the derivation rows instead (comparison 'derived', held to first-order rounding
    bounds, which a correct engine approaches by construction: apart, so that neither hides the other)."""
    best = None
    for r in rows if isinstance(rows, list) else []:
        if not isinstance(r, dict) or (r.get("comparison") == "derived") != derived:
            continue
        bound, ratio = r.get("bound"), r.get("ratio")
        if not r.get("passed") or not isinstance(bound, int | float) or bound <= 0 or not isinstance(ratio, int | float):
            continue
        if best is None or ratio > best["ratio"]:
            best = {k: r.get(k) for k in ("case", "tensor", "metric", "value", "bound", "ratio")}
    return best


def candidates_summary(verdict: Any) -> dict[str, Any] | None:
    """Per-case results of a readable verdict (an unreadable one is named by the verification's problems)."""
    if not readable(verdict):
        return None
    return {"passed": verdict["passed"], "complete": verdict.get("complete"), "waivers": waivers_of(verdict["rows"]),
            "closest_passing": closest_passing(verdict["rows"]),
            "closest_derived": closest_passing(verdict["rows"], derived=True),
            "cases": {name: _case_summary(name, c) for name, c in verdict["cases"].items()}}


def evidence_summary(docs: RunDocs) -> dict[str, Any]:
    """What the run's evidence weighs on disk: the reference as its stage recorded it (qualify.reference.summary
    .evidence_sizes) and each case of the verdict, measured now."""
    cases = sorted(docs.verdict["cases"]) if readable(docs.verdict) else []
    return {"reference": docs.reference.get("evidence"),
            "cases": {name: tree_bytes(docs.layout.case(name)) for name in cases},
            "cases_bytes_per_parameter_step": {name: bytes_per_parameter_step(docs.layout.case(name))
                                               for name in cases}}


def bytes_per_parameter_step(role_dir: Path) -> float | None:
    """A run's gradients, updates and moments on disk per parameter per step (16 for plain fp32 files; fewer where
    qualify.tensor_codec coded them); None where it has no readable gradients."""
    from qualify.store import TensorFile

    steps = sorted(p for p in Path(role_dir).glob("step*") if p.is_dir())
    try:
        grads = TensorFile(Path(role_dir) / "step0" / "grads.safetensors")
    except EvidenceError:
        return None
    params = sum(math.prod(grads.spec(name)[0]) for name in grads)
    kept = sum(tree_bytes(s) - ((s / "outputs.safetensors").stat().st_size if (s / "outputs.safetensors").is_file()
                                else 0) for s in steps)
    return round(kept / (params * len(steps)), 3) if params and steps else None


def rounds_summary(rounds: dict[int, Any]) -> list[dict[str, Any]]:
    return [{"vllm_tp": tp, "passed": doc.get("passed") if isinstance(doc, dict) else None,
             "num_checks": doc.get("num_checks") if isinstance(doc, dict) else None,
             "num_failed": doc.get("num_failed") if isinstance(doc, dict) else None}
            for tp, doc in sorted(rounds.items())]


def provenance(docs: RunDocs) -> dict[str, Any]:
    """Versions, digests, host, git and platform: the acceptance's where frozen, else the reference's."""
    src = docs.acceptance or docs.reference
    out = {key: src.get(key) for key in ("versions", "host", "git")}
    out["digests"] = {"acceptance": (docs.acceptance or {}).get("digest"),
                      "rollout": docs.reference.get("rollout_digest"),
                      "targets": docs.reference.get("targets_digest"),
                      **{f"rollout {tp}": d for tp, d in sorted(docs.reference.get("rollout_digests", {}).items())}}
    platform = (docs.acceptance or {}).get("platform", docs.reference.get("platform"))
    if platform is not None:
        out["platform"] = platform
    return out


def summarize_docs(docs: RunDocs, verification: Verification) -> dict[str, Any]:
    """What a person needs at a glance about a run, with what was verified."""
    ref, acc = docs.reference, docs.acceptance
    return {
        "run_dir": str(docs.layout.root),
        "matrix": ref["matrix"]["name"],
        "status": status_of(verification, docs.verdict, docs.rounds),
        "unfinished": unfinished_stages(docs),
        "verification": verification.to_json(),
        "rollout_digest": ref["rollout_digest"],
        "tp_agreement": ref["tp_agreement"],
        "rollout_mismatch": ref["rollout_mismatch"],
        "routing_agreement": ref.get("routing_agreement"),
        "rollout_self": ref.get("rollout_self"),
        "controls": ref["controls"],
        "acceptance": None if acc is None else {"digest": acc.get("digest"), "num_artifacts": len(acc.get("files", [])),
                                                "k": acc.get("rule", {}).get("k"),
                                                "bounds": sorted(acc.get("bounds", {}))},
        "candidates": candidates_summary(docs.verdict),
        "evidence": evidence_summary(docs),
        "steps": steps_summary(docs.verdict),
        "coverage": (acc or {}).get("coverage"),
        "rounds": rounds_summary(docs.rounds),
        "provenance": provenance(docs),
    }


def steps_summary(verdict: Any) -> dict[str, dict[str, int]]:
    """Per optimizer step, over every case: checks and failed checks (rows named 'step<k>/...')."""
    out: dict[str, dict[str, int]] = {}
    rows = verdict.get("rows") if isinstance(verdict, dict) else None
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict):
            continue
        head = str(row.get("tensor", "")).split("/", 1)[0]
        if head.startswith("step") and head[4:].isdigit():
            slot = out.setdefault(head, {"checks": 0, "failed": 0})
            slot["checks"] += 1
            slot["failed"] += not row.get("passed")
    return dict(sorted(out.items(), key=lambda kv: int(kv[0][4:])))


COVERAGE_COLUMNS = ("policy_clip_high", "policy_clip_low", "value_clip", "grad_clip", "kl", "padded_rows", "adam_step")


def coverage_lines(coverage: dict[str, Any] | None) -> list[str]:
    """The branches each reference step exercised, per role, as a Markdown table (frozen in the acceptance)."""
    if not coverage:
        return []
    lines = ["", f"Coverage (required: {', '.join(coverage.get('required', [])) or 'nothing'})", "",
             "| role | step | " + " | ".join(COVERAGE_COLUMNS) + " |", "| --- | --- |" + " --- |" * len(COVERAGE_COLUMNS)]
    for role, steps in coverage.get("steps", {}).items():
        for k, step in enumerate(steps):
            cells = ["" if c not in step else str(step[c]) for c in COVERAGE_COLUMNS]
            lines.append(f"| {role} | {k} | " + " | ".join(cells) + " |")
    return lines


def summarize(run_dir: Path) -> dict[str, Any]:
    """Load, verify and summarize a run directory."""
    docs = load_docs(run_dir)
    verification = verify_run(docs.layout, docs.reference, docs.acceptance, docs.verdict, docs.rounds)
    return summarize_docs(docs, verification)


def rollout_self_line(record: dict[str, Any]) -> str:
    """One line on the rollout engine's prefill of its own sequences against its decode (reference.json's
    rollout_self)."""
    if "skipped" in record:
        return f"vLLM's prefill vs its own decode: not measured ({record['skipped']})"
    return (f"vLLM's prefill vs its own decode: {record['num_not_bitwise']} of {record['num_tokens']} sampled tokens "
            f"differ, max |delta| {_ratio(record['max_abs'])} (an exact claim needs 0)")


def to_markdown(summary: dict[str, Any]) -> str:
    """The summary as a Markdown document."""
    lines = _header_lines(summary)
    cand = summary["candidates"]
    if cand is not None:
        lines += _candidate_lines(summary, cand)
    lines += coverage_lines(summary["coverage"])
    waived = waiver_text((cand or {}).get("waivers") or [])
    lines += ["", *verification_lines(summary["verification"])]
    lines += [f"- **{unfinished_line(entry)}**" for entry in summary["unfinished"]]
    lines += ["", f"**{summary['status']}**{waived}"]
    return "\n".join(lines) + "\n"


def _header_lines(summary: dict[str, Any]) -> list[str]:
    """The document's title and its list: the run, the rollout's agreements, platform, evidence, acceptance, rounds."""
    lines = [f"# qualify run: {summary['matrix']}", "", f"- run directory: `{summary['run_dir']}`",
             f"- rollout: `{summary['rollout_digest']}`", f"- controls: {', '.join(summary['controls'])}"]
    for tp, a in summary["tp_agreement"].items():
        lines.append(f"- vLLM {tp}: tokens equal {a['tokens_equal']}, logprob max |delta| {a['logprob_max_abs']}")
    for precision, mm in summary["rollout_mismatch"].items():
        if "total" in mm:  # decomposed: numerical error, truncation term, kept-set differences
            lines += [f"- {line.strip()}" for line in mismatch_lines(precision, mm)]
        else:
            lines.append(f"- train-vs-rollout {precision}: {mm['num_not_bitwise']}/{mm['num_tokens']} not bitwise, "
                         f"max |delta| {_ratio(mm['max_abs'])}, mean {_ratio(mm['mean_abs'])}")
    lines += [f"- {line.strip()}" for line in routing_lines(summary.get("routing_agreement"))]
    if summary.get("rollout_self"):
        lines.append(f"- {rollout_self_line(summary['rollout_self'])}")
    platform = summary["provenance"].get("platform")
    if platform:
        lines.append(f"- platform: {describe(platform)}")
    lines += _evidence_lines(summary.get("evidence") or {})
    acc = summary["acceptance"]
    if acc is None:
        lines.append("- acceptance: not frozen")
    else:
        lines.append(f"- acceptance: `{acc['digest']}` ({acc['num_artifacts']} artifacts, k = {acc['k']})")
    for r in summary["rounds"]:
        lines.append(f"- rounds vLLM tp{r['vllm_tp']}: {'PASS' if r['passed'] else 'FAIL'}, "
                     f"{r['num_checks']} checks, {r['num_failed']} failed")
    return lines


def _evidence_lines(evidence: dict[str, Any]) -> list[str]:
    """The reference's and the cases' evidence sizes (none when the summary has none)."""
    lines = []
    if evidence.get("reference"):
        lines.append(f"- {evidence_line(evidence['reference']).strip()}")
    if evidence.get("cases"):
        per = evidence.get("cases_bytes_per_parameter_step") or {}
        lines.append("- cases' evidence: " + ", ".join(
            f"{name} {size / 1e6:.1f} MB" + (f" ({per[name]:g} bytes per parameter per step)" if per.get(name) else "")
            for name, size in evidence["cases"].items()))
    return lines


def _candidate_lines(summary: dict[str, Any], cand: dict[str, Any]) -> list[str]:
    """The cases' table, the closest passing and derived rows, and the steps' table."""
    lines = ["", "| case | result | checks | failed | worst tensor | metric | value/bound |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    verified = summary["verification"]["ok"]
    for name, c in cand["cases"].items():
        w = c["worst"] or {}
        outcome = ("PASS" if c["passed"] else "FAIL") if verified else "unverified"
        lines.append(f"| {name} | {outcome} | {c['num_checks']} | {c['num_failed']} | "
                     f"{w.get('tensor', '')} | {w.get('metric', '')} | {_ratio(w.get('ratio'))} |")
    close, derived = cand.get("closest_passing"), cand.get("closest_derived")
    if close:
        lines += ["", (f"- false-alarm margin: the closest passing value/bound is {_ratio(close['ratio'])} "
                       f"({close['case']}, {close['tensor']} {close['metric']}: {_ratio(close['value'])} <= "
                       f"{_ratio(close['bound'])})")]
    if derived:
        lines += [(f"- derivation rows (first-order rounding bounds): the closest is {_ratio(derived['ratio'])} "
                   f"({derived['case']}, {derived['tensor']} {derived['metric']}: {_ratio(derived['value'])} <= "
                   f"{_ratio(derived['bound'])})")]
    if summary["steps"]:
        lines += ["", "| step | checks | failed |", "| --- | --- | --- |"]
        lines += [f"| {k.removeprefix('step')} | {v['checks']} | {v['failed']} |" for k, v in summary["steps"].items()]
    return lines


def verification_lines(v: dict[str, Any]) -> list[str]:
    lines = [f"- verified: {c}" for c in v["checked"]]
    return lines + [f"- **does not verify**: {p}" for p in v["problems"]]


def _ratio(value: Any) -> str:
    return "" if value is None else f"{value:.3g}" if isinstance(value, (int, float)) else str(value)


def exit_code(summary: dict[str, Any]) -> int:
    """0 for a verified PASSED with every stage finished; 1 otherwise (FAILED, NOT VERIFIED, NO VERDICT: a run whose
    candidate stage never finished is no success)."""
    return 0 if summary["status"] == PASSED and not summary["unfinished"] else 1
