"""Summary of a run directory: reference, acceptance, candidate verdict and rounds, as plain data.

The CLI renders it as a terminal summary, Markdown or JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError
from qualify.layout import RunLayout
from qualify.store import read_json


def _maybe(path: Path) -> Any:
    return read_json(path) if path.is_file() else None


def summarize(run_dir: Path) -> dict[str, Any]:
    """What a person needs at a glance about a run."""
    layout = RunLayout(Path(run_dir))
    ref = _maybe(layout.reference_summary)
    if ref is None:
        raise EvidenceError(f"{run_dir} holds no reference summary ({layout.reference_summary})")
    acc = _maybe(layout.acceptance)
    verdict = _maybe(layout.verdict)
    rounds = _maybe(layout.rounds / "verdict.json")
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "matrix": ref["matrix"]["name"],
        "rollout_digest": ref["rollout_digest"],
        "tp_agreement": ref["tp_agreement"],
        "rollout_mismatch": ref["rollout_mismatch"],
        "controls": ref["controls"],
        "acceptance": None if acc is None else {"digest": acc["digest"], "num_artifacts": len(acc["files"]),
                                                "k": acc["rule"]["k"], "bounds": sorted(acc["bounds"])},
        "candidates": None,
        "rounds": None if rounds is None else {"passed": rounds.get("passed")},
    }
    if verdict is not None:
        out["candidates"] = {"passed": verdict["passed"], "complete": verdict["complete"],
                             "cases": {name: {"passed": c["passed"], "num_checks": c["num_checks"],
                                              "num_failed": c["num_failed"],
                                              "worst": None if c["worst"] is None else
                                              {k: c["worst"][k] for k in ("comparison", "tensor", "metric", "value",
                                                                          "bound", "ratio")}}
                                       for name, c in verdict["cases"].items()}}
    return out


def to_markdown(summary: dict[str, Any]) -> str:
    """The summary as a Markdown document."""
    lines = [f"# qualify run: {summary['matrix']}", "", f"- run directory: `{summary['run_dir']}`",
             f"- rollout: `{summary['rollout_digest']}`", f"- controls: {', '.join(summary['controls'])}"]
    for tp, a in summary["tp_agreement"].items():
        lines.append(f"- vLLM {tp}: tokens equal {a['tokens_equal']}, logprob max |delta| {a['logprob_max_abs']}")
    for precision, mm in summary["rollout_mismatch"].items():
        lines.append(f"- train-vs-rollout {precision}: {mm['num_not_bitwise']}/{mm['num_tokens']} not bitwise, "
                     f"max |delta| {mm['max_abs']:.3g}, mean {mm['mean_abs']:.3g}")
    acc = summary["acceptance"]
    if acc is None:
        lines.append("- acceptance: not frozen")
    else:
        lines.append(f"- acceptance: `{acc['digest']}` ({acc['num_artifacts']} artifacts, k = {acc['k']})")
    cand = summary["candidates"]
    if cand is not None:
        lines += ["", "| case | result | checks | failed | worst tensor | metric | value/bound |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, c in cand["cases"].items():
            w = c["worst"] or {}
            lines.append(f"| {name} | {'PASS' if c['passed'] else 'FAIL'} | {c['num_checks']} | {c['num_failed']} | "
                         f"{w.get('tensor', '')} | {w.get('metric', '')} | {_ratio(w.get('ratio'))} |")
        lines += ["", f"**{'PASSED' if cand['passed'] else 'FAILED'}**"]
    return "\n".join(lines) + "\n"


def _ratio(value: Any) -> str:
    return "" if value is None else value if isinstance(value, str) else f"{value:.3g}"
