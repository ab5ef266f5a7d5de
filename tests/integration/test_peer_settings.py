"""A matrix with the peers' policy settings (asymmetric clip, verl's dual clip, an entropy bonus) end to end on the
committed rollout (its rollout section is matrices/tiny-qwen3.yaml's): the reference exercises the dual clip and both
asymmetric edges, freeze accepts it, torch-tp passes at fp32 and bf16, TP1 and TP2, and so does torch-tp bringing the
same objective through the engine hook. Each plugin of tests.integration.peer_plugins drops one setting and fails on
the tensors it moves, by at least 10x their bounds."""

from __future__ import annotations

import math

import pytest
import yaml

from qualify.candidate.stage import run_candidates
from qualify.freeze import freeze
from qualify.layout import RunLayout
from qualify.matrix import load_matrix
from qualify.store import read_json, read_tensors
from tests.conftest import COMMITTED, TINY
from tests.integration._support import matrix_with, plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.engines, pytest.mark.slow]
PLUGINS = "tests.integration.peer_plugins"
PEER_PPO = {"clip_eps_low": 0.15, "clip_eps_high": 0.28, "dual_clip_c": 1.02, "entropy_coef": 0.01}
"""DAPO's upper edge and a lower one of its own; c near 1 so that this rollout's few negative-advantage tokens whose
ratio rises (at most 1.11 by step 3) reach it; verl's default c = 3 would stay inert here."""
BUGS = {"symmetric_clip": "the asymmetric clip", "no_dual_clip": "the dual clip",
        "detached_entropy": "the entropy bonus's gradient"}


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory):
    """The peer matrix's reference (from the committed rollout) and acceptance; returns (matrix, run directory)."""
    from qualify.reference.stage import run_reference

    data = yaml.safe_load(TINY.read_text())
    data["name"] = "tiny-qwen3-peer"
    data["ppo"].update(PEER_PPO)
    data["freeze"]["require"] = [*data["freeze"]["require"], "policy_clip_dual"]
    data["candidates"].update(engines=["torch-tp"], roles=["actor"])
    base = tmp_path_factory.mktemp("peer")
    path = base / "matrix.yaml"
    path.write_text(yaml.safe_dump(data))
    matrix = load_matrix(path)
    run = base / "tiny-qwen3-peer"
    run_reference(matrix, run, rollout=COMMITTED / "reference" / "rollout")
    freeze(run)
    return matrix, run


def failing(verdict: dict, case: str) -> dict[tuple[str, str], float]:
    """{(tensor, metric): value / bound} of the case's failing rows."""
    out = {}
    for r in verdict["rows"]:
        if r["case"] == case and not r["passed"]:
            value, bound = float(r["value"]), float(r["bound"])
            out[(r["tensor"], r["metric"])] = math.inf if bound == 0 or not math.isfinite(value) else value / bound
    return out


def closest(verdict: dict, case: str) -> str:
    """Where a passing case came closest to failing: its largest value / bound among the rows judged against the
    reference's bounds, and among its derivation rows, each with the row."""
    out = []
    for kind in ("bound", "derived"):
        rows = [(float(r["value"]) / float(r["bound"]), f"{r['tensor']} {r['metric']}") for r in verdict["rows"]
                if r["case"] == case and (r["comparison"] in ("derived", "own outputs")) == (kind == "derived")
                and 0 < float(r["bound"]) < math.inf and math.isfinite(float(r["value"]))]
        ratio, row = max(rows)
        out.append(f"closest {kind} row {ratio:.3f} ({row})")
    return ", ".join(out)


def test_the_reference_exercises_every_peer_branch(peer_run):
    _, run = peer_run
    doc = read_json(RunLayout(run).acceptance)
    steps = doc["coverage"]["steps"]["actor"]
    assert {"policy_clip_high", "policy_clip_low", "policy_clip_dual"} <= set(doc["coverage"]["required"])
    for branch in ("policy_clip_high", "policy_clip_low", "policy_clip_dual"):
        assert sum(step[branch] for step in steps) > 0, (branch, steps)
    outputs = read_tensors(RunLayout(run).reference / "scores" / "fp32-r0" / "actor" / "step1" / "outputs.safetensors")
    entropy, mask = outputs["entropy_BT"], outputs["ratio_BT"] != 0
    assert bool((entropy[mask] > 0).all()) and not bool(entropy[~mask].any())


def case_name(engine: str, precision: str = "fp32", tp: int = 1) -> str:
    return f"{engine.replace(':', '-').replace('.', '-')}-{precision}-tp{tp}-actor"


def test_torch_tp_passes_at_fp32_bf16_tp1_and_tp2(peer_run, tmp_path):
    matrix, run = peer_run
    m = matrix_with(tmp_path, base=matrix.source, engines=["torch-tp"], precisions=["fp32", "bf16"], tp=[1, 2])
    verdict = run_candidates(m, run).to_json()
    for case in verdict["cases"]:
        assert verdict["cases"][case]["passed"], (case, sorted(failing(verdict, case).items())[:5])
        print(f"{case}: {closest(verdict, case)}")
    assert len(verdict["cases"]) == 4
    case = case_name("torch-tp")
    judged = {(r["tensor"], r["metric"]) for r in verdict["rows"] if r["case"] == case}
    assert ("step3/outputs/entropy_BT", "max_abs") in judged  # against the reference's
    derived = [r for r in verdict["rows"] if r["case"] == case and r["tensor"].endswith("outputs/entropy_BT")
               and r["metric"] == "derived_abs"]  # and from the case's own logits
    assert len(derived) == 4 and all(float(r["value"]) <= 0.5 * float(r["bound"]) for r in derived), derived


def test_each_dropped_setting_fails_on_what_it_moves(peer_run, tmp_path):
    matrix, run = peer_run
    engines = [f"{PLUGINS}:same_objective", *(f"{PLUGINS}:{bug}" for bug in BUGS)]
    m = matrix_with(tmp_path, base=matrix.source, engines=engines, precisions=["fp32"], tp=[1])
    verdict = run_candidates(m, run).to_json()
    same = case_name(engines[0])
    assert verdict["cases"][same]["passed"], sorted(failing(verdict, same).items())[:5]
    print(f"{same}: {closest(verdict, same)}")
    for bug, what in BUGS.items():
        case = case_name(f"{PLUGINS}:{bug}")
        bad = failing(verdict, case)
        assert bad, f"{case} ({what} dropped) passed"
        worst = max(bad.values())
        first = min(int(t.partition("/")[0].removeprefix("step")) for t, _ in bad if t.startswith("step"))
        named = [(t, m) for t, m in bad if "/outputs/" in t or "/decisions/" in t]
        grads = sorted(((t, m) for t, m in bad if "/grads/" in t), key=lambda tm: -bad[tm])[:2]
        print(f"{case}: {len(bad)} failing rows from step {first}, worst {worst:.3g} x its bound; "
              + ", ".join(f"{t} {m} {bad[(t, m)]:.3g}" for t, m in sorted(named) + grads))
        assert worst >= 10, (case, sorted(bad.items())[:8])
        if bug == "detached_entropy":  # the loss's value is right: only the gradients move, from the first step
            assert any(t.startswith("step0/grads/") and x >= 10 for (t, _), x in bad.items()), sorted(bad.items())[:8]
            assert ("step0/outputs/loss", "max_abs") not in bad
        else:  # a clip decision differs from step 1 on: the loss is not the matrix's objective of its own outputs
            assert any(t.endswith("outputs/loss") and m == "objective_abs" for t, m in bad), sorted(bad.items())[:8]
            assert any("/grads/" in t for t, _ in bad), sorted(bad.items())[:8]
            assert not any(t.startswith("step0/") for t, _ in bad)  # on-policy step 0 clips nothing
