"""Bad engines judged (offline) against the extended-perturbation acceptance (b) and the union (b'): value / bound."""
import math
import sys

from rules import FAM, Run, family_of

bad, a, b = Run('bad', sys.argv[1], sys.argv[2]), Run('a', sys.argv[3], sys.argv[2]), Run('b', sys.argv[4], sys.argv[5])
print("| case | worst bf16-repeat row: current | (b) extended controls | (b') union | failing bf16-repeat rows current / (b) / (b') |")
print("|---|---|---|---|---|")
for case in sorted(bad.verdict['cases']):
    w = {'a': None, 'b': None, 'u': None}; n = {'a': 0, 'b': 0, 'u': 0}
    for r in bad.rows:
        if r['case'] != case or family_of(r['comparison']) != FAM or not isinstance(r['value'], (int, float)): continue
        ea, eb = a.entry(r['role'], FAM, r['tensor'], r['metric']), b.entry(r['role'], FAM, r['tensor'], r['metric'])
        if ea is None or eb is None: continue
        for k, bound in (('a', ea['bound']), ('b', eb['bound']), ('u', max(ea['bound'], eb['bound']))):
            x = r['value'] / bound if bound > 0 else math.inf
            if w[k] is None or x > w[k][0]: w[k] = (x, r['tensor'], r['metric'])
            n[k] += x > 1
    f = lambda t: f"{t[0]:.3g} {t[1]} {t[2]}" if t else '-'
    print(f"| {case.replace('tests-integration-', '')} | {f(w['a'])} | {f(w['b'])} | {f(w['u'])} | {n['a']} / {n['b']} / {n['u']} |")
