"""The HTML report's figures, drawn with matplotlib (Agg, no display) and returned as inline SVG text.

Text is drawn as paths (no font needed by the viewer) and ids and metadata are fixed, so the same
data gives the same SVG bytes.
"""

from __future__ import annotations

import io
import math
import re
from typing import Any

import numpy as np

RATIO_CAP = 2.0  # value/bound above this is drawn as this (and labelled with its real value)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.fonttype": "path", "svg.hashsalt": "qualify", "font.size": 9})
    import matplotlib.pyplot as plt

    return plt


def to_svg(fig: Any) -> str:
    """The figure as an <svg> element (no XML prolog), figure closed."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": "qualify"})
    _pyplot().close(fig)
    text = buf.getvalue()
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.DOTALL)  # RDF boilerplate, no data
    return text[text.index("<svg"):]


def _label(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return "inf" if math.isinf(ratio) else f"{ratio:.2g}"


def heatmap(rows: list[str], cols: list[str], cells: dict[tuple[str, str], tuple[float | None, bool]],
            what: str = "case") -> str:
    """Worst value/bound per case (or what): rows x cols grid; cells[(row, col)] = (ratio or None, passed)."""
    plt = _pyplot()
    grid = np.full((len(rows), len(cols)), np.nan)
    for (r, c), (ratio, _) in cells.items():
        grid[rows.index(r), cols.index(c)] = min(ratio, RATIO_CAP) if ratio is not None else 0.0
    fig, ax = plt.subplots(figsize=(2.5 + 1.2 * len(cols), 1.0 + 0.45 * len(rows)))
    cmap = plt.get_cmap("RdYlGn_r").with_extremes(bad="#dddddd")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=RATIO_CAP, aspect="auto")
    for (r, c), (ratio, passed) in cells.items():
        ax.text(cols.index(c), rows.index(r), _label(ratio) + ("" if passed else "\nFAIL"), ha="center", va="center",
                fontsize=8, fontweight="normal" if passed else "bold")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_title(f"worst value/bound per {what} (colour capped at {RATIO_CAP:g}; grey: none)")
    fig.colorbar(image, ax=ax, label="value/bound")
    return to_svg(fig)


def family_bars(cases: list[str], families: list[str], ratios: dict[tuple[str, str], float]) -> str:
    """Largest value/bound per tensor family, one bar per case in each family group."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.0, 0.6 + 0.22 * max(1, len(cases)) * len(families)))
    height = 0.8 / max(1, len(cases))
    for i, case in enumerate(cases):
        ys = [j + i * height for j in range(len(families))]
        xs = [min(ratios.get((case, f), 0.0), RATIO_CAP) for f in families]
        ax.barh(ys, xs, height=height, label=case)
    ax.axvline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(families))], families)
    ax.set_xlim(0, RATIO_CAP)
    ax.set_xlabel("largest value/bound in the family (1 = at the bound)")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="lower right")
    return to_svg(fig)


def delta_histogram(deltas: dict[str, np.ndarray]) -> str:
    """|train - rollout| logprob per response token, per precision, on a log axis (zeros counted apart)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.0, 3.0))
    nonzero = [d[d > 0] for d in deltas.values()]
    lo = min((float(d.min()) for d in nonzero if d.size), default=1e-8)
    hi = max((float(d.max()) for d in nonzero if d.size), default=1.0)
    bins = np.logspace(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1e-9, 40)
    for (precision, d), nz in zip(deltas.items(), nonzero):
        ax.hist(nz, bins=bins, alpha=0.6, label=f"{precision} ({d.size - nz.size} of {d.size} tokens bitwise equal)")
    ax.set_xscale("log")
    ax.set_xlabel("|reference logprob - vLLM sampler logprob| per response token")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    return to_svg(fig)
