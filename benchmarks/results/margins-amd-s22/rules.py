"""Evaluate bound-rule alternatives offline on a run (verdict + frozen bounds + extract.py's per-control/pair records).

Usage: python rules.py NAME=RUN:EXTRACT.json [...]   (prints markdown)
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from qualify.bounds.control_error import LOSS_KEY, MEAN_KEYS, NORM_KEY
from qualify.bounds.rule import in_compute_precision, ulp
from qualify.compare import merge_max

FAM = "bf16-repeat"


def family_ce(records: list[dict]) -> dict:
    """freeze's control error of one step from raw records (bounds_from_records without the updates)."""
    errors: dict = {}
    for r in records:
        merge_max(errors, r["metrics"])

    def raise_to(key, scales):
        if "max_abs" in errors.get(key, {}) and scales and all(s is not None for s in scales):
            errors[key]["max_abs"] = max(errors[key]["max_abs"], *scales)
    raise_to(LOSS_KEY, [r["loss_terms"] for r in records])
    raise_to(NORM_KEY, [r["grad_difference"] for r in records])
    for key in MEAN_KEYS:
        raise_to(key, [r["means"].get(key) for r in records])
    return errors


def control_effective(rec: dict, key: str, metric: str) -> float | None:
    """One control's own error on a key/metric, raised by its own scale (loss terms, grad difference, means)."""
    v = rec["metrics"].get(key, {}).get(metric)
    if v is None:
        return None
    if metric == "max_abs":
        s = {LOSS_KEY: rec["loss_terms"], NORM_KEY: rec["grad_difference"]}.get(key)
        if key in MEAN_KEYS:
            s = rec["means"].get(key)
        if s is not None:
            v = max(v, s)
    return v


def finite(r):
    return r["passed"] and isinstance(r["bound"], (int, float)) and 0 < r["bound"] < math.inf \
        and isinstance(r["value"], (int, float))


def family_of(comparison: str) -> str | None:
    return comparison.rsplit("[", 1)[1].rstrip("]") if comparison.endswith("]") else None


class Run:
    def __init__(self, name, run, extract):
        self.name, self.dir = name, Path(run)
        self.verdict = json.loads((self.dir / "candidates/verdict.json").read_text())
        self.rows = self.verdict["rows"]
        self.ex = json.loads(Path(extract).read_text())
        self.bounds = {}
        for f in (self.dir / "acceptance/bounds").glob("*.json"):
            d = json.loads(f.read_text())
            self.bounds[(d["role"], d["family"])] = d
        self.k = next(iter(self.bounds.values()))["k"]
        # control errors, per role: current (r0 vs each control) and pairwise
        self.ce_cur, self.ce_pair = {}, {}
        for role, rd in self.ex["roles"].items():
            pc = rd["per_control"][FAM]
            for k in range(rd["steps"]):
                s = f"step{k}"
                for key, ms in family_ce([c[s] for c in pc.values()]).items():
                    for m, v in ms.items():
                        self.ce_cur[(role, f"{s}/{key}", m)] = v
                for key, ms in family_ce([p[s] for p in rd["pairs"].values()]).items():
                    for m, v in ms.items():
                        self.ce_pair[(role, f"{s}/{key}", m)] = v

    def check(self):
        """How well extract's per-control records reproduce freeze's bf16-repeat control errors."""
        worst, n = 0.0, 0
        for (role, fam), d in self.bounds.items():
            if fam != FAM:
                continue
            for key, ms in d["bounds"].items():
                for m, e in ms.items():
                    if m == "replay_max_abs":
                        continue
                    mine = self.ce_cur.get((role, key, m))
                    if mine is None:
                        continue
                    n += 1
                    ref = e["control_error"]
                    rel = abs(mine - ref) / ref if ref else abs(mine)
                    worst = max(worst, rel)
        return n, worst

    def entry(self, role, fam, tensor, metric):
        return self.bounds.get((role, fam), {}).get("bounds", {}).get(tensor, {}).get(metric)


def rule_bound(run: Run, rule: str, role, fam, tensor, metric, old: dict) -> float:
    """The row's bound under a rule (old: the frozen entry)."""
    ce, floor, q, k = old["control_error"], old["floor"], old["quantum"], run.k
    if fam != FAM or metric == "replay_max_abs":
        return old["bound"]
    step = int(tensor.split("/")[0].removeprefix("step"))
    key = (role, tensor, metric)
    if rule == "current":
        return old["bound"]
    if rule == "pairs":
        ce = max(ce, run.ce_pair.get(key, ce))
    elif rule in ("k5", "k6"):
        if step >= 1:
            k = float(rule[1])
    elif rule == "pairs+k5":
        ce = max(ce, run.ce_pair.get(key, ce))
        if step >= 1:
            k = 5.0
    elif rule == "ulp":
        # control error rounded up to whole bf16 rounding steps at the tensor's magnitude, for what bf16 computes
        # (gradients, values) and absolute metrics
        if metric != "rel_l2" and in_compute_precision(tensor.split("/", 1)[1]):
            u = ulp("bf16", old.get("magnitude", 0.0))
            if u > 0:
                ce = math.ceil(ce / u - 1e-12) * u
    elif rule == "kq":
        # the quantum inside the multiplier: k x (control error + one rounding step) + floor, at steps >= 1
        if step >= 1:
            return k * (ce + q) + floor
    elif rule == "pairs1":
        # pairs at steps >= 1 only
        if step >= 1:
            ce = max(ce, run.ce_pair.get(key, ce))
    elif rule == "ulp+1":
        # the control error plus one more bf16 step of the magnitude (a second quantum) at steps >= 1
        if step >= 1 and metric != "rel_l2" and in_compute_precision(tensor.split("/", 1)[1]):
            q = 2 * q
    else:
        raise ValueError(rule)
    return k * ce + floor + q


RULES = ["current", "pairs", "pairs1", "k5", "k6", "pairs+k5", "ulp", "kq"]


def evaluate(run: Run, rules=RULES, extra: dict | None = None):
    """Per rule: closest bound row (value/bound) over all passing bound rows, and growth of bf16-repeat bounds."""
    out = {}
    for rule in rules:
        best, bbest, grow = None, None, []
        for r in run.rows:
            if r["comparison"] == "derived" or not finite(r):
                continue
            fam = family_of(r["comparison"])
            old = run.entry(r["role"], fam, r["tensor"], r["metric"]) if fam else None
            b = r["bound"] if old is None else rule_bound(run, rule, r["role"], fam, r["tensor"], r["metric"], old)
            ratio = r["value"] / b
            if best is None or ratio > best[0]:
                best = (ratio, r)
            if fam == FAM and (bbest is None or ratio > bbest[0]):
                bbest = (ratio, r)
        for (role, fam), d in run.bounds.items():
            if fam != FAM:
                continue
            for key, ms in d["bounds"].items():
                for m, e in ms.items():
                    if m == "replay_max_abs" or e["bound"] <= 0:
                        continue
                    grow.append(rule_bound(run, rule, role, fam, key, m, e) / e["bound"])
        out[rule] = (best, bbest, statistics.median(grow), max(grow))
    return out


def short(r):
    return f"{r['case'].replace('torch-tp-', 'tt-').replace('deepspeed-', 'ds-')} `{r['comparison'].replace('vs ref ', '')}` {r['tensor']} {r['metric']}"


def fmt(x):
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def top_table(run: Run, n=10):
    """The n closest passing bound rows of the bf16 TP2 cases, with every control of the row's family."""
    rows = [r for r in run.rows if r["comparison"] != "derived" and finite(r) and family_of(r["comparison"])]
    rows.sort(key=lambda r: -r["value"] / r["bound"])
    seen, lines = set(), []
    for r in rows:
        fam = family_of(r["comparison"])
        ident = (r["case"].replace("deepspeed", "E").replace("torch-tp", "E"), r["comparison"], r["tensor"], r["metric"], r["value"])
        if ident in seen:   # torch-tp and deepspeed often give the same numbers: one line, both named
            continue
        seen.add(ident)
        old = run.entry(r["role"], fam, r["tensor"], r["metric"])
        rd = run.ex["roles"][r["role"]]
        step, key = r["tensor"].split("/", 1)
        ctrl = {}
        if old and r["metric"] != "replay_max_abs" and fam in rd["per_control"]:
            for name, recs in rd["per_control"][fam].items():
                ctrl[name.removeprefix("bf16-")] = control_effective(recs[step], key, r["metric"])
        largest = max((v for v in ctrl.values() if v is not None), default=None)
        pair = run.ce_pair.get((r["role"], r["tensor"], r["metric"])) if fam == FAM else None
        lines.append((r, fam, old, ctrl, largest, pair))
        if len(lines) >= n:
            break
    return lines


def main():
    runs = []
    for arg in sys.argv[1:]:
        name, rest = arg.split("=", 1)
        run, ex = rest.split(":")
        runs.append(Run(name, run, ex))
    for run in runs:
        n, worst = run.check()
        print(f"\n## {run.name} ({run.dir})\n")
        print(f"extract vs frozen bf16-repeat control errors: {n} entries, worst relative difference {worst:.2e}\n")
        print("### closest passing bound rows (bf16-repeat and fp32-vs-bf16 rows), with each control's error\n")
        lines = top_table(run)
        print("| value/bound | case (torch-tp = deepspeed where both) | family | tensor, metric | case | bound = 4 x control error + floor + quantum | largest control | case / largest | pairwise max / control error | each control's error |")
        print("|---:|---|---|---|---:|---|---|---:|---:|---|")
        for r, fam, old, ctrl, largest, pair in lines:
            ratio = r["value"] / largest if largest else math.inf
            top = max(ctrl, key=lambda c: ctrl[c] or 0) if ctrl else "-"
            cs = ", ".join(f"{c} {fmt(v)}" for c, v in ctrl.items())
            pr = f"{pair / old['control_error']:.2f}" if pair and old["control_error"] else "-"
            print(f"| {r['value'] / r['bound']:.3f} | {r['case']} | {fam} | `{r['tensor']}` {r['metric']} | {fmt(r['value'])} | "
                  f"{fmt(r['bound'])} = {run.k:g} x {fmt(old['control_error'])} + {fmt(old['floor'])} + {fmt(old['quantum'])} | "
                  f"{top} | {ratio:.2f} | {pr} | {cs} |")
        print("\n### rules\n")
        print("| rule | closest bound row (all families) | its row | closest bf16-repeat row | its row | median new/old bf16-repeat bound | max new/old |")
        print("|---|---:|---|---:|---|---:|---:|")
        for rule, (best, bbest, med, mx) in evaluate(run).items():
            ratio, r = best
            bratio, b = bbest
            print(f"| {rule} | {ratio:.3f} | {short(r)} | {bratio:.3f} | {short(b)} | {med:.3f} | {mx:.3f} |")


if __name__ == "__main__":
    main()
