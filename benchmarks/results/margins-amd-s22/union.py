"""(b') union: the original matrix's controls and the extended matrix's (two 'combined' draws), bound = max of the two
frozen bounds (same r0, floor and quantum). Optionally with the pairwise rule on each side."""
import statistics
import sys

from rules import FAM, Run, family_of, finite, rule_bound

for name in sys.argv[1:]:
    a, b = Run(name, name, f'{name}.extract.json'), Run(name + 'x', name + 'x', f'{name}x.extract.json')
    for rule in ('current', 'pairs'):
        best = bb = None
        grow = []
        for r in b.rows:
            if r['comparison'] == 'derived' or not finite(r):
                continue
            fam = family_of(r['comparison'])
            eb = b.entry(r['role'], fam, r['tensor'], r['metric']) if fam else None
            ea = a.entry(r['role'], fam, r['tensor'], r['metric']) if fam else None
            if eb is None or ea is None:
                bound = r['bound']
            else:
                ra = rule_bound(a, rule, r['role'], fam, r['tensor'], r['metric'], ea)
                rb = rule_bound(b, rule, r['role'], fam, r['tensor'], r['metric'], eb)
                bound = max(ra, rb)
            x = r['value'] / bound
            if best is None or x > best[0]: best = (x, r)
            if fam == FAM and (bb is None or x > bb[0]): bb = (x, r)
        for (role, fam), d in a.bounds.items():
            if fam != FAM: continue
            for key, ms in d['bounds'].items():
                for m, e in ms.items():
                    eb = b.entry(role, fam, key, m)
                    if m == 'replay_max_abs' or not e['bound'] or eb is None: continue
                    grow.append(max(rule_bound(a, rule, role, fam, key, m, e), rule_bound(b, rule, role, fam, key, m, eb)) / e['bound'])
        print(f"| {name} | union{'+pairs' if rule == 'pairs' else ''} | {best[0]:.3f} | {best[1]['case']} {best[1]['comparison']} {best[1]['tensor']} {best[1]['metric']} | {bb[0]:.3f} | {bb[1]['case']} {bb[1]['tensor']} {bb[1]['metric']} | {statistics.median(grow):.3f} | {max(grow):.3f} |")
