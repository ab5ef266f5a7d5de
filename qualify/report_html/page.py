"""HTML fragments of the report page: banner, sections, tables. Every value is escaped; nothing is fetched."""

from __future__ import annotations

from html import escape
from typing import Any

from qualify.report import FAILED, NO_VERDICT, NOT_VERIFIED, PASSED, rollout_self_line, unfinished_line
from qualify.report_html.data import fmt
from qualify.waivers import waiver_text

CSS = """
body { font-family: sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; margin-top: 1.6em; }
h3 { font-size: 0.95em; margin: 0.8em 0 0.2em; }
#banner { font-size: 1.6em; font-weight: bold; padding: 0.6em 1em; border-radius: 6px; color: white; }
#banner.pass { background: #1a7f37; } #banner.fail { background: #cf222e; }
#banner.unverified { background: #6e1111; } #banner.none { background: #6e7781; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-family: monospace; }
tr.failed td { background: #ffebe9; } tr.near td.ratio { background: #fff8c5; }
.problems li { color: #cf222e; } code { font-size: 0.9em; word-break: break-all; }
details > summary { cursor: pointer; font-weight: bold; margin: 0.4em 0; }
figure { margin: 0.5em 0; } figure svg { max-width: 100%; height: auto; }
"""
BANNERS = {PASSED: ("pass", "PASS"), FAILED: ("fail", "FAIL"), NOT_VERIFIED: ("unverified", "NOT VERIFIED"),
           NO_VERDICT: ("none", "NO VERDICT")}


def document(title: str, parts: list[str]) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{escape(title)}</title>\n'
            f"<style>{CSS}</style>\n</head>\n<body>\n<h1>{escape(title)}</h1>\n" + "\n".join(parts)
            + "\n</body>\n</html>\n")


def banner(summary: dict[str, Any]) -> str:
    """PASS or FAIL only after the evidence verified; otherwise NOT VERIFIED (or NO VERDICT) and why."""
    css, word = BANNERS[summary["status"]]
    cand = summary["candidates"]
    detail = ""
    if summary["status"] in (PASSED, FAILED) and cand is not None:
        failed = sum(not c["passed"] for c in cand["cases"].values())
        detail = f": {len(cand['cases']) - failed}/{len(cand['cases'])} cases pass"
        detail += waiver_text(cand.get("waivers") or [])  # beside the result: each check the matrix waived
    elif summary["status"] == NOT_VERIFIED:
        detail = ": the evidence does not verify, so no result is shown as a pass"
    elif summary.get("unfinished"):
        detail = ": " + "; ".join(unfinished_line(u) for u in summary["unfinished"])
    return f'<div id="banner" class="{css}" data-status="{escape(summary["status"])}">{word}{escape(detail)}</div>'


def verification(v: dict[str, Any], unfinished: list[dict[str, str]] | None = None) -> str:
    """What was verified, every problem, and every stage that did not finish (qualify.report.unfinished_stages)."""
    checked = "".join(f"<li>{escape(c)}</li>" for c in v["checked"]) or "<li>nothing to verify yet</li>"
    problems = "".join(f"<li>{escape(p)}</li>" for p in [*v["problems"], *map(unfinished_line, unfinished or [])])
    return (f'<section id="verification"><h2>Verification</h2><ul>{checked}</ul>'
            + (f'<ul class="problems">{problems}</ul>' if problems else "") + "</section>")


def figure(title: str, svg: str, ident: str) -> str:
    return f'<section id="{escape(ident)}"><h2>{escape(title)}</h2><figure>{svg}</figure></section>'


def table(header: list[str], rows: list[list[Any]], classes: list[str] | None = None) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        cells = "".join(f'<td class="num">{escape(fmt(c))}</td>' if isinstance(c, (int, float)) and
                        not isinstance(c, bool) else f"<td>{escape(fmt(c))}</td>" for c in row)
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def rollout_section(summary: dict[str, Any], histogram_svg: str | None) -> str:
    """Train-vs-rollout mismatch per precision (the reference's numbers) and its distribution."""
    rows = [[p, m["num_tokens"], m["num_not_bitwise"], m["max_abs"], m["mean_abs"]]
            for p, m in summary["rollout_mismatch"].items()]
    tp = [[k, a["tokens_equal"], a["logprob_max_abs"]] for k, a in summary["tp_agreement"].items()]
    ra = summary.get("routing_agreement") or {}
    moe_layers = ra.get("moe_layers") or []
    routes = [[moe_layers[a["layer"]] if a["layer"] < len(moe_layers) else a["layer"], a["tokens"], a["tokens_differ"],
               a["pairs"], a["pairs_differ"]] for a in ra.get("reference_fp32_vs_rollout", [])]
    own = summary.get("rollout_self")
    return ('<section id="rollout"><h2>Train vs rollout</h2>'
            + table(["precision", "tokens", "not bitwise", "max |delta|", "mean |delta|"], rows)
            + (f"<p>{escape(rollout_self_line(own))}</p>" if own else "")
            + (table(["vLLM TP", "tokens equal", "logprob max |delta|"], tp) if tp else "")
            + (f'<h3 id="routing">Routing ({escape(str(ra.get("routing")))}): the rollout\'s routes vs the fp32 '
               "reference's own top-k</h3>"
               + table(["MoE layer", "tokens", "tokens routed elsewhere", "(token, slot) pairs", "pairs differ"], routes)
               if routes else "")
            + (f"<figure>{histogram_svg}</figure>" if histogram_svg else "") + "</section>")


def rounds_section(rounds: list[dict[str, Any]]) -> str:
    if not rounds:
        return '<section id="rounds"><h2>Rounds</h2><p>no rounds run in this directory</p></section>'
    rows = [[f"vllm-tp{r['vllm_tp']}", "PASS" if r["passed"] else "FAIL", r["num_checks"], r["num_failed"]]
            for r in rounds]
    return '<section id="rounds"><h2>Rounds</h2>' + table(["run", "result", "checks", "failed"], rows) + "</section>"


def _flat(prefix: str, value: Any) -> list[list[Any]]:
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _flat(f"{prefix}.{k}" if prefix else str(k), v)]
    if isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
        return [[prefix, ", ".join(map(str, value))]]
    return [[prefix, value if isinstance(value, (str, int, float, bool)) or value is None else str(value)]]


def mapping_section(title: str, ident: str, mapping: dict[str, Any]) -> str:
    rows = [[key, fmt(value)] for key, value in _flat("", mapping)]
    return f'<section id="{escape(ident)}"><h2>{escape(title)}</h2>' + table(["key", "value"], rows) + "</section>"


def cases_overview(cases: dict[str, dict[str, Any]], verified: bool) -> str:
    """One line per case: outcome, counts and its worst row (the outcome says 'unverified' when it is)."""
    rows = []
    for name, c in cases.items():
        w = c["worst"] or {}
        outcome = ("PASS" if c["passed"] else "FAIL") if verified else "unverified"
        rows.append([name, outcome, c["num_checks"], c["num_failed"], w.get("tensor", ""), w.get("metric", ""),
                     w.get("ratio", "")])
    return ('<h2 id="cases">Cases</h2>'
            + table(["case", "result", "checks", "failed", "worst tensor", "metric", "value/bound"], rows,
                    ["failed" if r[1] != "PASS" else "" for r in rows]))


def coverage_section(coverage: dict[str, Any]) -> str:
    """Per role and optimizer step, how often each branch of the objective and optimizer was taken (sealed in the
    acceptance); the branches freeze required are marked."""
    steps = coverage.get("steps", {})
    required = set(coverage.get("required", []))
    keys = sorted({k for per_role in steps.values() for s in per_role for k in s}, key=lambda k: (k not in required, k))
    rows = [[role, i, *[s.get(k, "") for k in keys]] for role, per_role in steps.items() for i, s in enumerate(per_role)]
    header = ["role", "step", *[f"{k} (required)" if k in required else k for k in keys]]
    return '<section id="coverage"><h2>Coverage</h2>' + table(header, rows) + "</section>"


def margin_line(closest: dict[str, Any] | None, derived: dict[str, Any] | None = None) -> str:
    """The false-alarm margin: the passing bound row nearest its bound, and the derivation row nearest its rounding
    bound."""
    out = ""
    for row, element, text in ((closest, "margin", "False-alarm margin: the closest passing value/bound is"),
                               (derived, "derived-margin",
                                "Derivation rows (first-order rounding bounds): the closest is")):
        if not row:
            continue
        ratio, case, tensor, metric, value, bound = (escape(short(row.get(k))) for k in
                                                     ("ratio", "case", "tensor", "metric", "value", "bound"))
        out += f'<p id="{element}">{text} <b>{ratio}</b> ({case}, {tensor} {metric}: {value} &lt;= {bound}).</p>'
    return out


def short(v: Any) -> str:
    """A number in 3 significant digits; anything else (text, or what a forged verdict holds) as text."""
    return f"{v:.3g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
