"""The HTML report's diagnosis section: value/bound by layer for every `qualify diagnose` run of the directory.

Shown only for evidence that verified and for diagnoses made against this acceptance (a diagnosis of an
older acceptance is listed as stale, not plotted). One figure per case: the worst value/bound of each
layer's forward outputs and of its gradients, per bound family, on a log axis with the bound at 1.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from qualify.report_html.page import figure, table
from qualify.report_html.plots import _pyplot, to_svg

RATIO_FLOOR = 1e-3  # value/bound below this (bitwise-equal layers: 0) is drawn at it on the log axis


def layer_plot(doc: dict[str, Any]) -> str:
    """value/bound by layer (model order), one line per (family, forward or backward); the first departure marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.0, 3.2))
    labels: list[str] = []
    for fam in doc["families"].values():
        for entry in fam["layers"]:
            if entry["layer"] not in labels:
                labels.append(entry["layer"])
    for family, fam in doc["families"].items():
        for phase, marker in (("forward", "o"), ("backward", "s")):
            points = [(labels.index(e["layer"]), max(float(e[phase]), RATIO_FLOOR)) for e in fam["layers"]
                      if e[phase] is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker=marker, linestyle="-" if phase == "forward" else "--",
                        label=f"{phase} vs {fam['reference_run']} [{family}]")
    first = doc.get("first_departure")
    if first:
        ax.axvline(labels.index(first["layer"]), color="#cf222e", linewidth=1, linestyle=":")
        ax.annotate(f"first out of bound: {first['key']}", (labels.index(first["layer"]), 1.0), fontsize=7,
                    color="#cf222e", xytext=(4, 8), textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("layer (model order)")
    ax.set_ylabel(f"worst value/bound (< {RATIO_FLOOR:g} drawn at it)")
    ax.legend(fontsize=7, loc="best")
    return to_svg(fig)


def diagnosis_sections(run_dir: Path, acceptance_digest: str | None, verified: bool) -> list[str]:
    """The diagnosis section (empty when no diagnosis exists in the run)."""
    from qualify.diagnose.stage import load_diagnoses

    diagnoses = load_diagnoses(run_dir)
    if not diagnoses:
        return []
    if not verified:
        return ['<section id="diagnosis"><h2>Layer diagnosis</h2><p>not shown: the evidence does not verify</p></section>']
    parts, stale = [], []
    for case, doc in diagnoses.items():
        if doc.get("acceptance_digest") != acceptance_digest:
            stale.append([case, doc.get("acceptance_digest")])
            continue
        first = doc.get("first_departure")
        text = (f"first out of bound: layer {first['layer']}, {first['key']} ({first['phase']}, {first['metric']} "
                f"{float(first['value']):.3g} > {float(first['bound']):.3g}, [{first['family']}])" if first
                else "every layer within bound")
        parts.append(f'<div class="diagnosis" data-case="{escape(case)}"><p><b>{escape(case)}</b>: '
                     f"{escape(text)}</p>" + figure(f"value/bound by layer: {case}", layer_plot(doc),
                                                   f"diagnosis-{case}") + "</div>")
    if stale:
        parts.append("<p>diagnoses made against another acceptance (run qualify diagnose again):</p>"
                     + table(["case", "acceptance"], stale))
    return ['<section id="diagnosis"><h2>Layer diagnosis (qualify diagnose, step 1)</h2>' + "".join(parts)
            + "</section>"]
