"""Known-bad engines under the candidate rules: per case, the worst bf16-repeat bound row (value / bound) and whether
the case still fails (any failing row once the bf16-repeat bounds are re-made by the rule).
Usage: python badeval.py NAME=RUN:EXTRACT.json"""
import math
import sys

from rules import FAM, RULES, Run, family_of, rule_bound


def num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)

for arg in sys.argv[1:]:
    name, rest = arg.split('=', 1)
    run = Run(name, *rest.split(':'))
    cases = sorted(run.verdict['cases'])
    print(f"\n### {name}\n")
    print("| case | rule | worst bf16-repeat row (value/bound) | failing bf16-repeat rows | failing rows of other kinds (derived, evidence, other families) | case fails |")
    print("|---|---|---|---:|---:|---|")
    for case in cases:
        rows = [r for r in run.rows if r['case'] == case]
        for rule in RULES:
            worst, nb, other = None, 0, 0
            for r in rows:
                fam = family_of(r['comparison'])
                old = run.entry(r['role'], fam, r['tensor'], r['metric']) if fam else None
                if fam == FAM and old is not None and num(r['value']) and num(r['bound']):
                    b = rule_bound(run, rule, r['role'], fam, r['tensor'], r['metric'], old)
                    ratio = r['value'] / b if b > 0 else math.inf
                    if worst is None or ratio > worst[0]:
                        worst = (ratio, r)
                    nb += ratio > 1
                elif not r['passed']:
                    other += 1
            w = f"{worst[0]:.3g} {worst[1]['tensor']} {worst[1]['metric']}" if worst else "-"
            print(f"| {case} | {rule} | {w} | {nb} | {other} | {'FAIL' if nb or other else 'pass'} |")
