"""Rule (b): the same matrix with batch_order, fused_projections, fused_norm added. Bound growth per family, values
unchanged check, closest rows. Usage: python bcompare.py OLD NEW"""
import json
import statistics
import sys
from pathlib import Path

from rules import family_of, finite


def load(run):
    b = {}
    for f in Path(run, 'acceptance/bounds').glob('*.json'):
        d = json.loads(f.read_text())
        for key, ms in d['bounds'].items():
            for m, e in ms.items():
                b[(d['role'], d['family'], key, m)] = e['bound']
    v = json.loads(Path(run, 'candidates/verdict.json').read_text())
    return b, v

old, new = sys.argv[1], sys.argv[2]
bo, vo = load(old); bn, vn = load(new)
for fam in ('fp32-repeat', 'bf16-repeat', 'fp32-vs-bf16'):
    rs = [bn[k] / bo[k] for k in bo if k[1] == fam and k in bn and bo[k] > 0 and k[3] != 'replay_max_abs']
    rr = [bn[k] / bo[k] for k in bo if k[1] == fam and k in bn and bo[k] > 0 and k[3] == 'replay_max_abs']
    print(f"{fam}: outputs/grads bounds new/old median {statistics.median(rs):.3f} max {max(rs):.3f} min {min(rs):.3f} (n={len(rs)}); "
          f"update replay median {statistics.median(rr):.3f} max {max(rr):.3f}")
ko = {(r['case'], r['comparison'], r['tensor'], r['metric']): r for r in vo['rows']}
diff = sum(1 for r in vn['rows'] if (k := (r['case'], r['comparison'], r['tensor'], r['metric'])) in ko
           and ko[k]['value'] != r['value'] and isinstance(r['value'], (int, float)))
print(f"rows whose value differs between the two runs: {diff} of {len(vn['rows'])}")
for label, v in (('old', vo), ('new', vn)):
    rows = [r for r in v['rows'] if r['comparison'] != 'derived' and finite(r)]
    best = max(rows, key=lambda r: r['value'] / r['bound'])
    bb = max((r for r in rows if family_of(r['comparison']) == 'bf16-repeat'), key=lambda r: r['value'] / r['bound'])
    print(f"{label}: {v['passed'] and 'PASSED' or 'FAILED'}; closest bound row {best['value']/best['bound']:.3f} {best['case']} {best['comparison']} {best['tensor']} {best['metric']}; "
          f"closest bf16-repeat {bb['value']/bb['bound']:.3f} {bb['case']} {bb['tensor']} {bb['metric']}")
