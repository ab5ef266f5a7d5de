"""Is a correct bf16 case 'one more draw' of the controls? Per bf16-repeat entry (outputs and grads, steps >= 1):
 - each control held out: its error / the largest of the other controls (what it would score, as a case, in units of
   the control error; value/bound at k = 4 is about this / 4), and / the pairwise max among the runs without it
 - each bf16 case with a nonzero value: value / control error (the same statistic for the real cases)
Usage: python loo.py NAME=RUN:EXTRACT.json ...
"""
from __future__ import annotations

import math
import sys

from rules import FAM, Run, control_effective, family_ce, family_of, finite

QS = (0.5, 0.9, 0.99)


def quant(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(label, xs):
    xs = [x for x in xs if not math.isnan(x)]
    n = len(xs)
    if not n:
        return f"| {label} | 0 | | | | | | |"
    over = lambda t: sum(x > t for x in xs) / n
    return (f"| {label} | {n} | {quant(xs, .5):.2f} | {quant(xs, .9):.2f} | {quant(xs, .99):.2f} | {max(xs):.2f} | "
            f"{over(1.0):.1%} | {over(1.6):.2%} | {over(2.0):.2%} |")


def main():
    print("| draws | n | median | p90 | p99 | max | > 1 | > 1.6 (0.4 at k=4) | > 2 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for arg in sys.argv[1:]:
        name, rest = arg.split("=", 1)
        run = Run(name, *rest.split(":"))
        loo, loo_pairs, cases, cases_pairs = [], [], [], []
        worst = []
        for role, rd in run.ex["roles"].items():
            pc = rd["per_control"][FAM]
            names = list(pc)
            for k in range(1, rd["steps"]):
                s = f"step{k}"
                # pairwise ce without run c, for each c
                without = {}
                for c in names:
                    recs = [p[s] for key, p in rd["pairs"].items() if c not in key.split("|")]
                    without[c] = family_ce(recs)
                keys = {(key, m) for c in names for key, ms in pc[c][s]["metrics"].items() for m in ms}
                for key, m in keys:
                    if not key.startswith(("outputs/", "grads/")):
                        continue
                    vals = {c: control_effective(pc[c][s], key, m) for c in names}
                    for c, v in vals.items():
                        if not v:
                            continue
                        others = max((w for d, w in vals.items() if d != c and w is not None), default=0)
                        if others > 0:
                            loo.append(v / others)
                            worst.append((v / others, name, role, c, s, key, m))
                        p = without[c].get(key, {}).get(m)
                        if p:
                            loo_pairs.append(v / p)
        for r in run.rows:
            if family_of(r["comparison"]) != FAM or not r["comparison"].startswith("vs ref") or not finite(r):
                continue
            if r["step"] < 1 or r["metric"] == "replay_max_abs" or not r["value"] or "-bf16-" not in r["case"]:
                continue
            e = run.entry(r["role"], FAM, r["tensor"], r["metric"])
            if e is None or not e["control_error"]:
                continue
            cases.append(r["value"] / e["control_error"])
            p = run.ce_pair.get((r["role"], r["tensor"], r["metric"]))
            if p:
                cases_pairs.append(r["value"] / p)
        print(summarize(f"{name}: control held out / largest other control", loo))
        print(summarize(f"{name}: control held out / pairwise max without it", loo_pairs))
        print(summarize(f"{name}: bf16 case / control error", cases))
        print(summarize(f"{name}: bf16 case / pairwise control error", cases_pairs))
        worst.sort(reverse=True)
        for w in worst[:5]:
            print(f"|   worst held-out: {w[0]:.2f} {w[2]} {w[3]} {w[4]}/{w[5]} {w[6]} | | | | | | | | |")


if __name__ == "__main__":
    main()
