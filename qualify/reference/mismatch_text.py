"""Train-vs-rollout mismatch as lines for people: shared by `qualify reference` and `qualify report`."""

from __future__ import annotations


def _g(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


LISTED_TOKENS = 20
"""Kept-set differences listed by token in these lines; the reference summary (reference.json) holds every one."""


def mismatch_lines(precision: str, mm: dict) -> list[str]:
    """Train-vs-rollout of one precision: numerical error, truncation term, total, kept-set differences (the first
    LISTED_TOKENS by token: at a real shape they can be thousands)."""
    n, total, trunc, differs = mm["num_tokens"], mm["total"], mm["truncation"], mm["kept_set_differs"]
    lines = [(f"  train-vs-rollout {precision}: {n - mm['num_not_bitwise']}/{n} tokens bitwise equal to the processed "
             f"formula; numerical |delta| max {_g(mm['max_abs'])}, mean {_g(mm['mean_abs'])}"),
             (f"    truncation (full - processed): {trunc['num_truncated']} tokens truncated, |term| max "
             f"{_g(trunc['max_abs'])}, mean {_g(trunc['mean_abs'])}; vs the full formula: "
             f"{total['num_not_bitwise']}/{n} not bitwise, max {_g(total['max_abs'])}, mean {_g(total['mean_abs'])}"),
             (f"    kept set differs (beyond {differs['limit']:.3g} or outside the reference's kept set): "
             f"{differs['count']} tokens")]
    lines += [f"      row {t['row']} position {t['position']}: sampler {t['sampler']:.7g}, reference processed "
              f"{'-inf (outside its kept set)' if t['processed'] is None else format(t['processed'], '.7g')}"
              for t in differs["tokens"][:LISTED_TOKENS]]
    if len(differs["tokens"]) > LISTED_TOKENS:
        lines.append(f"      ... and {len(differs['tokens']) - LISTED_TOKENS} more (reference.json lists every one)")
    return lines


def evidence_line(e: dict) -> str:
    """One line on the reference's evidence size (qualify.reference.summary.evidence_sizes)."""
    mb = 1e6
    per = e.get("bytes_per_parameter_step")
    kept = "kept lean (outputs and gradients)" if e.get("mode") == "lean" else "kept in full"
    return (f"  evidence ({e['mode']}): {e['reference_bytes'] / mb:.1f} MB; {e['full_runs']} run(s) {kept} "
            f"{e['full_runs_bytes'] / mb:.1f} MB" + (f" ({per:g} bytes per parameter per step)" if per else "")
            + f", {e['summaries']} control(s) kept as summaries {e['summaries_bytes'] / mb:.1f} MB, replays "
            f"{e['replays_bytes'] / mb:.1f} MB")


def routing_lines(ra: dict | None) -> list[str]:
    """A MoE rollout's routes against the fp32 reference's own routing, per layer (nothing for a dense actor)."""
    if not ra:
        return []
    lines = [(f"  routing ({ra['routing']}): the rollout's routes vs the fp32 reference's own top-k at the rollout's "
             "weights")]
    for a in ra["reference_fp32_vs_rollout"]:
        layer = (ra.get("moe_layers") or [])[a["layer"]] if ra.get("moe_layers") else a["layer"]
        lines.append(f"    layer {layer}: {a['tokens_differ']}/{a['tokens']} tokens route to other experts, "
                     f"{a['pairs_differ']}/{a['pairs']} (token, slot) pairs differ")
    return lines
