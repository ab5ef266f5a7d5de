"""The freeze rule, checked directly: bound = k * control error + floor + quantum, with non-zero control errors.

The synthetic reference (tests/unit/_runs.py) gives every control a known, distinct error, so the
family's runs, the max over them, k, the floor of each kind and the quantum all show in the numbers.
Expected values are computed here from the tensors, not by qualify.compare.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from qualify.acceptance import check_acceptance
from qualify.bounds.control_error import magnitudes
from qualify.bounds.rule import BOUNDS_SCHEMA, FAMILIES, RULE, bound_entry, family_pairs, quantum
from qualify.compare import merge_max
from qualify.errors import EvidenceError, FrozenError
from qualify.freeze import ACCEPTANCE_SCHEMA, freeze, run_dir_of
from qualify.layout import RunLayout
from qualify.manifest import load_manifest, verify_manifest
from qualify.store import read_json, write_json
from tests.unit._runs import (
    COEF,
    FLOORS,
    OPT,
    OUTPUT_NAMES,
    K,
    params,
    role_run,
    synthetic_matrix,
    synthetic_reference,
    unstep,
)

# (reference run, control runs) of each family, written out by hand.
FAMILY_RUNS = {"fp32-repeat": (("fp32", "r0"), [("fp32", "r1"), ("fp32", "r2")]),
               "bf16-repeat": (("bf16", "r0"), [("bf16", "r1"), ("bf16", "r2")]),
               "fp32-vs-bf16": (("fp32", "r0"), [("bf16", "r0"), ("bf16", "r1"), ("bf16", "r2")])}
# The run whose error is the family's largest (COEF is built that way).
WORST = {"fp32-repeat": ("fp32", "r1"), "bf16-repeat": ("bf16", "r1"), "fp32-vs-bf16": ("bf16", "r0")}
OUTPUT_KINDS = {"logprobs_BT": "logprob", "values_BT": "value", "loss": "loss", "grad_norm": "grad_norm"}


def test_family_pairs_name_the_reference_and_its_controls():
    controls = ["r0", "r1", "microbatch_split", "attn_impl"]
    assert family_pairs("fp32-repeat", controls) == ("fp32-r0", ["fp32-r1", "fp32-microbatch_split", "fp32-attn_impl"])
    assert family_pairs("bf16-repeat", controls) == ("bf16-r0", ["bf16-r1", "bf16-microbatch_split", "bf16-attn_impl"])
    assert family_pairs("fp32-vs-bf16", controls) == (
        "fp32-r0", ["bf16-r0", "bf16-r1", "bf16-microbatch_split", "bf16-attn_impl"])


def test_bound_entry_is_k_times_error_plus_floor_plus_quantum():
    floors = {"grad": 0.25, "relative": 0.5}
    assert bound_entry("grad", 0.125, 3.0, floors, 2.0 ** -10) == {
        "kind": "grad", "control_error": 0.125, "floor": 0.25, "quantum": 2.0 ** -10,
        "bound": 3.0 * 0.125 + 0.25 + 2.0 ** -10}
    assert bound_entry("relative", 0.125, 5.0, floors) == {"kind": "relative", "control_error": 0.125, "floor": 0.5,
                                                           "quantum": 0.0, "bound": 5.0 * 0.125 + 0.5}


def test_merge_max_keeps_the_largest_value_per_key_and_metric():
    into: dict = {}
    merge_max(into, {"a": {"max_abs": 0.5}})
    merge_max(into, {"a": {"max_abs": 2.0, "rel_l2": 0.25}, "b": {"max_abs": 0.75}})
    merge_max(into, {"a": {"max_abs": 1.0, "rel_l2": 0.125}})
    assert into == {"a": {"max_abs": 2.0, "rel_l2": 0.25}, "b": {"max_abs": 0.75}}


@pytest.mark.parametrize("precision, metric, magnitude, expected", [
    ("fp32", "max_abs", 1.0, 2.0 ** -23), ("fp32", "max_abs", 0.75, 2.0 ** -24), ("bf16", "max_abs", 3.0, 2.0 ** -6),
    ("fp32", "rel_l2", 5.0, 2.0 ** -23), ("bf16", "rel_l2", 0.0, 2.0 ** -7),
    ("fp32", "max_abs", -1.0, 0.0), ("fp32", "max_abs", math.inf, 0.0), ("fp32", "max_abs", math.nan, 0.0)])
def test_quantum(precision, metric, magnitude, expected):
    assert quantum(precision, metric, magnitude) == expected


def test_magnitudes_are_the_largest_absolute_value_of_each_tensor():
    run = role_run("actor", 0.0)
    run.outputs["empty"] = torch.zeros(0)
    mags = magnitudes(run)
    assert mags["outputs/empty"] == 0.0
    assert mags["grads/w"] == float(run.grads["w"].double().abs().max()) > 0
    assert mags["updates/b"] == float(run.updates["b"].double().abs().max()) > 0
    assert not any(key.startswith("moments/") for key in mags)  # no bound is made for them
    assert set(mags) == {f"{g}/{n}" for g in ("outputs", "grads", "updates") for n in getattr(run, g)}


# --- the whole freeze on a synthetic reference -------------------------------------------------------------------

@pytest.fixture
def frozen(tmp_path):
    """A synthetic reference, frozen (per test: freeze runs inside each test that reads its output, which is
    also what lets mutation testing map freeze's code to these tests)."""
    layout = synthetic_reference(tmp_path / "run", synthetic_matrix(tmp_path))
    return layout, freeze(layout.root)


@pytest.fixture
def fresh(tmp_path):
    """A synthetic reference not frozen yet, for tests that change it."""
    return synthetic_reference(tmp_path / "run", synthetic_matrix(tmp_path))


def _max_abs(a, b):
    return float((a.double() - b.double()).abs().max())


def _rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _replay_error(update, p, m, v):
    """|update - AdamW's first step from (p, m, v)|, written out in float64."""
    b1, b2 = OPT.betas
    p, m, v = p.double(), m.double(), v.double()
    step = OPT.lr * (m / (1 - b1)) / ((v / (1 - b2)).sqrt() + OPT.eps)
    return float((update.double() - (p * (1 - OPT.lr * OPT.weight_decay) - step - p)).abs().max())


def _ulp(precision, magnitude):
    return 2.0 ** (math.floor(math.log2(magnitude)) - {"fp32": 23, "bf16": 7}[precision])


FLOOR_ULPS = 4.0  # the Freeze default the synthetic matrix keeps


def _mean_abs(a, b):
    return float((a.double() - b.double()).abs().mean())


def _p99_abs(a, b):
    """Nearest rank, written out: the ceil(0.99 n)-th smallest |a - b|."""
    diffs = sorted((a.double() - b.double()).abs().flatten().tolist())
    return diffs[math.ceil(0.99 * len(diffs)) - 1]


def _floor(kind, metric, magnitude):
    scaled = FLOOR_ULPS * (2.0 ** -23 if metric == "rel_l2" else (_ulp("fp32", magnitude) if magnitude > 0 else 0.0))
    return max(FLOORS[kind], scaled)


def expected_bounds(role, family):
    """The family's bound file contents, from the tensors: {key: {metric: (error, kind, quantum, floor)}}."""
    base_id, others_ids = FAMILY_RUNS[family]
    base, others = role_run(role, COEF[base_id]), [role_run(role, COEF[i]) for i in others_ids]
    precision = "fp32" if family == "fp32-repeat" else "bf16"
    out = {}
    for group in ("outputs", "grads"):  # moments: no bound (derived from the case's own gradients)
        for name, ref in getattr(base, group).items():
            kind = OUTPUT_KINDS[name] if group == "outputs" else group.rstrip("s")
            mag = float(ref.abs().max())
            # only what the contract computes in bf16 (gradients, values) may spend one bf16 rounding step
            low = precision == "bf16" and (group != "outputs" or name == "values_BT")
            q = _ulp("bf16", mag) if low else 0.0
            error = max(_max_abs(getattr(r, group)[name], ref) for r in others)
            if (group, name) == ("outputs", "grad_norm"):  # at least the norm of the whole gradient's difference
                error = max(error, max(math.sqrt(sum(float((r.grads[n].double() - g.double()).square().sum())
                                                     for n, g in base.grads.items())) for r in others))
            metrics = {"max_abs": (error, kind, q, _floor(kind, "max_abs", mag))}
            if group != "outputs":
                metrics["rel_l2"] = (max(_rel_l2(getattr(r, group)[name], ref) for r in others), "relative",
                                     2.0 ** -7 if low else 0.0, _floor("relative", "rel_l2", mag))
            if ref.numel() > 1:
                metrics["mean_abs"] = (max(_mean_abs(getattr(r, group)[name], ref) for r in others), kind, q,
                                       _floor(kind, "mean_abs", mag))
                metrics["p99_abs"] = (max(_p99_abs(getattr(r, group)[name], ref) for r in others), kind, q,
                                      _floor(kind, "p99_abs", mag))
            out[f"{group}/{name}"] = metrics
    for name, p in params().items():  # updates: the replay of each run's own moments (not compared across runs)
        q = _ulp("fp32", float(p.abs().max()))
        floor = _floor("update", "max_abs", float(base.updates[name].abs().max()))
        out[f"updates/{name}"] = {
            "replay_max_abs": (max(_replay_error(r.updates[name], p, r.moments[f"exp_avg/{name}"],
                                                 r.moments[f"exp_avg_sq/{name}"]) for r in [base, *others]),
                               "update", q, floor)}
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_every_bound_is_k_times_the_largest_control_error_plus_floor_and_quantum(frozen, role, family):
    layout, _ = frozen
    doc = read_json(layout.bounds / f"{role}-{family}.json")
    base_id, others_ids = FAMILY_RUNS[family]
    assert doc["reference_run"] == "-".join(base_id) and doc["control_runs"] == ["-".join(i) for i in others_ids]
    assert (doc["schema"], doc["role"], doc["family"], doc["k"], doc["floors"], doc["rule"]) == (
        BOUNDS_SCHEMA, role, family, K, FLOORS, RULE)
    expected, bounds = expected_bounds(role, family), unstep(doc["bounds"])
    assert {k: sorted(v) for k, v in bounds.items()} == {k: sorted(v) for k, v in expected.items()}
    assert doc["floor_ulps"] == FLOOR_ULPS
    for key, metrics in expected.items():
        for metric, (error, kind, q, floor) in metrics.items():
            b = bounds[key][metric]
            where = f"{role}-{family} {key} {metric}"
            assert b["control_error"] == pytest.approx(error, rel=1e-9, abs=0), where
            assert (b["kind"], b["quantum"]) == (kind, q), where
            assert b["floor"] == pytest.approx(floor, rel=1e-12, abs=0), where
            assert b["bound"] == pytest.approx(K * error + floor + q, rel=1e-12, abs=0), where
    worst_key = f"outputs/{OUTPUT_NAMES[role]}"
    worst = _max_abs(role_run(role, COEF[WORST[family]]).outputs[OUTPUT_NAMES[role]],
                     role_run(role, COEF[base_id]).outputs[OUTPUT_NAMES[role]])
    assert bounds[worst_key]["max_abs"]["control_error"] == worst > 0, "the largest error comes from WORST"


def test_the_synthetic_controls_have_distinct_nonzero_errors():
    """What the test above relies on: in each family the worst run is strictly worse than every other."""
    for family, (base_id, others_ids) in FAMILY_RUNS.items():
        base = role_run("actor", COEF[base_id]).grads["w"]
        errors = {i: _max_abs(role_run("actor", COEF[i]).grads["w"], base) for i in others_ids}
        worst = errors.pop(WORST[family])
        assert all(0 < e < worst for e in errors.values()), (family, errors, worst)


def test_acceptance_names_the_rule_digests_and_evidence(frozen):
    layout, doc = frozen
    assert read_json(layout.acceptance) == doc == load_manifest(layout.acceptance)
    assert doc["schema_version"] == ACCEPTANCE_SCHEMA and doc["name"] == doc["matrix"] == "tiny-qwen3"
    assert (doc["platform"], doc["rollout_platform"]) == ({"cpu": "unit"}, {"cpu": "capture"})
    assert doc["rule"] == {"text": RULE, "k": K, "floors": FLOORS, "floor_ulps": FLOOR_ULPS, "quantum": True,
                           "families": list(FAMILIES)}
    summary = read_json(layout.reference_summary)
    for key in ("rollout_digest", "targets_digest", "matrix_digest", "versions", "host", "git"):
        assert doc[key] == summary[key], key
    assert sorted(doc["bounds"]) == sorted(f"{r}-{f}.json" for r in ("actor", "critic") for f in FAMILIES)
    assert doc["evidence"] == "../reference" and verify_manifest(layout.acceptance, progress=False).ok
    assert check_acceptance(layout.acceptance) == []


def test_freeze_again_is_identical_and_a_changed_bound_is_refused(fresh):
    freeze(fresh.root)
    before = {p.name: p.read_bytes() for p in [fresh.acceptance, *fresh.bounds.iterdir()]}
    assert freeze(fresh.reference) == read_json(fresh.acceptance)  # given as its reference/ directory too
    assert {p.name: p.read_bytes() for p in [fresh.acceptance, *fresh.bounds.iterdir()]} == before
    bound_file = fresh.bounds / "critic-fp32-vs-bf16.json"
    doc = read_json(bound_file)
    key = next(k for k in doc["bounds"] if k.endswith("grads/w"))
    doc["bounds"][key]["max_abs"]["bound"] *= 2
    write_json(bound_file, doc)
    with pytest.raises(FrozenError, match="critic-fp32-vs-bf16.json"):
        freeze(fresh.root)
    assert fresh.acceptance.read_bytes() == before["acceptance.json"]


def test_a_missing_bound_file_is_written_and_nothing_else_changes(fresh):
    freeze(fresh.root)
    before = fresh.acceptance.read_bytes()
    (fresh.bounds / "actor-bf16-repeat.json").unlink()
    freeze(fresh.root, name="tiny-qwen3")
    assert (fresh.bounds / "actor-bf16-repeat.json").is_file() and fresh.acceptance.read_bytes() == before


def test_freeze_names_the_acceptance(fresh):
    assert freeze(fresh.root, name="my-stack")["name"] == "my-stack"


def test_run_dir_of_accepts_the_run_or_its_reference(frozen):
    layout, _ = frozen
    assert run_dir_of(layout.root) == layout.root and run_dir_of(layout.reference) == layout.root


def _edit_summary(layout: RunLayout, **changes):
    summary = read_json(layout.reference_summary)
    write_json(layout.reference_summary, summary | changes)


@pytest.mark.parametrize("tamper, error, match", [
    (lambda lay: lay.reference_summary.unlink(), FrozenError, "no complete reference"),
    (lambda lay: _edit_summary(lay, matrix_digest="sha256:" + "0" * 64), EvidenceError, "names matrix snapshot"),
    (lambda lay: _edit_summary(lay, rollout_digest="sha256:" + "0" * 64), EvidenceError, "names rollout"),
    (lambda lay: _edit_summary(lay, targets_digest="sha256:" + "0" * 64), EvidenceError, "names targets"),
    (lambda lay: (lay.matrix_snapshot / "_complete.json").unlink(), EvidenceError, "matrix snapshot"),
    (lambda lay: (lay.model("reward") / "model.safetensors").write_bytes(b"x"), EvidenceError, "reward model"),
    (lambda lay: (lay.rollout(2) / "_complete.json").unlink(), EvidenceError, "rollout TP2"),
    (lambda lay: (lay.targets / "_complete.json").unlink(), EvidenceError, "targets"),
    (lambda lay: (lay.scores("bf16", "r2", "critic") / "meta.json").write_text("{}\n "), EvidenceError,
     "reference bf16 r2 critic"),
], ids=["no-summary", "matrix-digest", "rollout-digest", "targets-digest", "snapshot-unsealed", "model-modified",
        "rollout-tp2-unsealed", "targets-unsealed", "score-modified"])
def test_freeze_refuses_a_reference_that_is_not_the_sealed_one(fresh, tamper, error, match):
    tamper(fresh)
    with pytest.raises(error, match=match):
        freeze(fresh.root)
    assert not fresh.acceptance.exists() and not fresh.bounds.exists()


def test_committed_style_acceptance_of_the_synthetic_run_is_sound_and_a_broken_rule_is_caught(frozen, tmp_path):
    layout, _ = frozen
    copy = tmp_path / "acceptance"
    shutil.copytree(layout.acceptance_dir, copy)
    bound = copy / "bounds" / "actor-fp32-repeat.json"
    doc = json.loads(bound.read_text())
    entry = next(b for k, b in doc["bounds"].items() if k.endswith("grads/w"))["max_abs"]
    entry["bound"] = entry["control_error"] + FLOORS["grad"]
    bound.write_text(json.dumps(doc))
    problems = check_acceptance(copy / "acceptance.json")
    assert any("actor-fp32-repeat.json" in p and "does not match" in p for p in problems), problems


# --- several steps, and the coverage freeze requires ----------------------------------------------------------------

def _replay_error_at(update, p, m, v, step):
    """|update - AdamW step `step` from (p, m, v)|, written out in float64 with step's bias correction."""
    b1, b2 = OPT.betas
    p, m, v = p.double(), m.double(), v.double()
    delta = OPT.lr * (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + OPT.eps)
    return float((update.double() - (p * (1 - OPT.lr * OPT.weight_decay) - delta - p)).abs().max())


def test_family_bounds_of_two_steps_replay_each_step_from_its_own_start(tmp_path):
    from qualify.bounds.control_error import family_bounds
    from tests.unit._runs import role_steps, write_steps

    layout = RunLayout(tmp_path)
    runs = {pc: role_steps("actor", COEF[pc], 2) for pc in [("fp32", "r0"), ("fp32", "r1"), ("fp32", "r2")]}
    for (precision, control), steps in runs.items():
        write_steps(layout.scores(precision, control, "actor"), steps)
    doc = family_bounds(layout, "actor", "fp32-repeat", ["r0", "r1", "r2"], K, FLOORS, params(), OPT, True)
    assert doc["num_steps"] == 2
    assert {key.split("/")[0] for key in doc["bounds"]} == {"step0", "step1"}
    base = runs[("fp32", "r0")]
    for step in (0, 1):
        for name, p in params().items():
            errors = []
            for steps in runs.values():
                start = p.double() + (steps[0].updates[name].double() if step else 0)
                errors.append(_replay_error_at(steps[step].updates[name], start, steps[step].moments[f"exp_avg/{name}"],
                                               steps[step].moments[f"exp_avg_sq/{name}"], step + 1))
            b = doc["bounds"][f"step{step}/updates/{name}"]["replay_max_abs"]
            base_start = p.double() + (base[0].updates[name].double() if step else 0)
            q = _ulp("fp32", float(base_start.abs().max()))
            assert b["control_error"] == pytest.approx(max(errors), rel=1e-6, abs=1e-15) and max(errors) < 2.0 ** -21
            assert (b["quantum"], b["bound"]) == (q, pytest.approx(K * b["control_error"] + FLOORS["update"] + q))
        grads1 = doc["bounds"]["step1/grads/w"]["max_abs"]["control_error"]
        assert grads1 == 2 * doc["bounds"]["step0/grads/w"]["max_abs"]["control_error"] > 0  # step 1: 2x the gradients


def test_family_bounds_refuse_controls_with_another_number_of_steps(tmp_path):
    from qualify.bounds.control_error import family_bounds
    from tests.unit._runs import role_steps, write_steps

    layout = RunLayout(tmp_path)
    for control, num in (("r0", 2), ("r1", 2), ("r2", 1)):
        write_steps(layout.scores("bf16", control, "critic"), role_steps("critic", COEF[("bf16", control)], num))
    with pytest.raises(EvidenceError, match="critic bf16-repeat: controls took different numbers of steps than bf16-r0"):
        family_bounds(layout, "critic", "bf16-repeat", ["r0", "r1", "r2"], K, FLOORS, params(), OPT, True)


def test_freeze_refuses_a_reference_that_left_a_required_branch_inert(tmp_path):
    matrix = synthetic_matrix(tmp_path, require=("kl", "value_clip"))
    layout = synthetic_reference(tmp_path / "run", matrix, coverage={"actor": [{"kl": 0, "adam_step": 1}],
                                                                     "critic": [{"value_clip": 3, "adam_step": 1}]})
    with pytest.raises(FrozenError, match=r"the reference left 1 required branch\(es\) inert \(freeze.require\): kl: "):
        freeze(layout.root)
    assert not layout.acceptance.exists()
    both = synthetic_reference(tmp_path / "run2", synthetic_matrix(tmp_path, require=("kl", "value_clip")))
    with pytest.raises(FrozenError, match=r"2 required branch\(es\) inert \(freeze.require\): kl: .*\); value_clip: "):
        freeze(both.root)


def test_freeze_records_the_coverage_it_required(tmp_path):
    matrix = synthetic_matrix(tmp_path, require=("kl",))
    coverage = {"actor": [{"kl": 5, "adam_step": 1}], "critic": [{"value_clip": 0, "adam_step": 1}]}
    layout = synthetic_reference(tmp_path / "run", matrix, coverage=coverage)
    assert freeze(layout.root)["coverage"] == {"required": ["kl"], "steps": coverage}


def test_a_control_name_with_a_hyphen_names_its_own_directory(tmp_path):
    """Run names are '<precision>-<control>': only the first hyphen separates them."""
    from qualify.bounds.control_error import family_bounds
    from tests.unit._runs import role_steps, write_steps

    layout = RunLayout(tmp_path)
    for control, coef in (("r0", 0.0), ("mb-split-2", 1e-4)):
        write_steps(layout.scores("fp32", control, "actor"), role_steps("actor", coef, 1))
        write_steps(layout.scores("bf16", control, "actor"), role_steps("actor", coef + 3e-4, 1))
    for family, runs in (("fp32-repeat", ["fp32-mb-split-2"]), ("fp32-vs-bf16", ["bf16-r0", "bf16-mb-split-2"])):
        doc = family_bounds(layout, "actor", family, ["r0", "mb-split-2"], K, FLOORS, params(), OPT, True)
        assert doc["control_runs"] == runs and doc["bounds"]["step0/grads/w"]["max_abs"]["control_error"] > 0


def test_a_refused_refreeze_names_every_changed_file(fresh):
    freeze(fresh.root)
    changed = [fresh.bounds / "actor-bf16-repeat.json", fresh.bounds / "critic-fp32-repeat.json"]
    for path in changed:
        path.write_text(path.read_text() + " ")
    with pytest.raises(FrozenError) as caught:
        freeze(fresh.root)
    assert str(caught.value) == (f"an acceptance already exists for this reference and differs: {changed[0]}, "
                                 f"{changed[1]} (a frozen acceptance is never rewritten or widened)")


def test_without_the_quantum_every_bound_is_k_times_error_plus_floor(tmp_path):
    from qualify.bounds.control_error import family_bounds
    from tests.unit._runs import role_steps, write_steps

    layout = RunLayout(tmp_path)
    for control in ("r0", "r1"):
        write_steps(layout.scores("bf16", control, "critic"), role_steps("critic", COEF[("bf16", control)], 1))
    doc = family_bounds(layout, "critic", "bf16-repeat", ["r0", "r1"], K, FLOORS, params(), OPT, False)
    entries = [b for ms in doc["bounds"].values() for b in ms.values()]
    assert {m for ms in doc["bounds"].values() for m in ms} == {"max_abs", "rel_l2", "mean_abs", "p99_abs",
                                                               "replay_max_abs"}
    assert all(b["quantum"] == 0.0 and b["bound"] == K * b["control_error"] + b["floor"] for b in entries)


def test_freeze_refusals_name_what_and_where(fresh):
    """The messages in full: a hand-edited summary, an unsealed snapshot or targets, a summary that is no object."""
    summary = read_json(fresh.reference_summary)
    snapshot = read_json(fresh.matrix_snapshot / "_complete.json")["info"]["digest"]
    _edit_summary(fresh, matrix_digest="sha256:" + "0" * 64)
    with pytest.raises(EvidenceError) as caught:
        freeze(fresh.root)
    assert str(caught.value) == (f"{fresh.reference_summary} names matrix snapshot sha256:{'0' * 64}, "
                                 f"not the sealed {snapshot}")
    write_json(fresh.reference_summary, summary)
    for stage, what in ((fresh.targets, "targets"),
                        (fresh.matrix_snapshot, "matrix snapshot (made by 'qualify reference'; rerun it)")):
        marker = (stage / "_complete.json").read_bytes()
        (stage / "_complete.json").unlink()
        with pytest.raises(EvidenceError) as caught:
            freeze(fresh.root)
        assert str(caught.value) == f"{what} at {stage} is missing, partial or modified; rerun the stage that makes it"
        (stage / "_complete.json").write_bytes(marker)
    fresh.reference_summary.write_text("[]")
    with pytest.raises(EvidenceError) as caught:
        freeze(fresh.root)
    assert str(caught.value) == f"{fresh.reference_summary}: not a reference summary (a JSON list, not an object)"
