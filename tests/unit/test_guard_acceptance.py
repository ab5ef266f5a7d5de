"""qualify.acceptance, what mutation testing found unpinned (TESTING.md, run F): Acceptance.load's refusals in full
and what it passes to verify_manifest, the accessors, require_rollout both ways, a GRPO acceptance's bound-file set,
an acceptance without a rule, check_bounds' rule checks and per-tensor floors, and read_snapshot's error source.

The acceptance is a synthetic reference frozen once (tests/unit/_runs.py); each test edits a private copy, with the
acceptance's own digest recomputed so that only the check under test sees the edit.
"""

from __future__ import annotations

import shutil

import pytest

import qualify.acceptance as acceptance_module
from qualify.acceptance import ACCEPTANCE_SCHEMA, Acceptance, check_acceptance, read_snapshot
from qualify.bounds.check import check_bounds
from qualify.bounds.rule import BOUNDS_SCHEMA
from qualify.errors import EvidenceError, ManifestError, MatrixError
from qualify.freeze import freeze
from qualify.manifest import digest_of
from qualify.store import read_json, write_json
from tests.unit._runs import synthetic_matrix, synthetic_reference


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard-acc")
    layout = synthetic_reference(root / "run", synthetic_matrix(root))
    freeze(layout.root)
    return layout


@pytest.fixture
def acc(frozen, tmp_path):
    """A private copy of the acceptance directory, away from its reference (its default evidence is not there)."""
    shutil.copytree(frozen.acceptance_dir, tmp_path / "acceptance")
    return tmp_path / "acceptance" / "acceptance.json"


def rewrite(acc, drop=(), **changes):
    d = {k: v for k, v in read_json(acc).items() if k not in drop} | changes
    d["digest"] = digest_of(d)
    write_json(acc, d)


# --- Acceptance.load ---------------------------------------------------------------------------------------------

def test_load_reads_every_bound_file_against_the_given_evidence(acc, frozen):
    loaded = Acceptance.load(acc, frozen.reference)
    assert sorted(loaded.families) == sorted((r, f) for r in ("actor", "critic")
                                             for f in ("fp32-repeat", "bf16-repeat", "fp32-vs-bf16"))
    assert loaded.digest == read_json(acc)["digest"]


def test_load_without_evidence_uses_the_reference_the_acceptance_names(acc, frozen):
    """The copy's '../reference' does not exist: without evidence the load looks there, and fails."""
    with pytest.raises(ManifestError) as caught:
        Acceptance.load(acc)
    assert str(caught.value) == f"evidence root is not a directory: {acc.parent.parent / 'reference'}"
    Acceptance.load(frozen.acceptance)  # in place, its '../reference' is the reference


def test_load_passes_evidence_no_bar_and_partial_to_verify_manifest(acc, frozen, monkeypatch):
    calls = []
    real = acceptance_module.verify_manifest

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(acceptance_module, "verify_manifest", spy)
    Acceptance.load(acc, frozen.reference)
    Acceptance.load(acc, frozen.reference, partial=True)
    assert calls == [((acc, frozen.reference), {"progress": False, "partial": False}),
                     ((acc, frozen.reference), {"progress": False, "partial": True})]


def test_load_of_a_partial_copy_of_the_evidence(acc, frozen, tmp_path):
    evidence = tmp_path / "evidence"
    shutil.copytree(frozen.reference, evidence)
    victim = min(p for p in evidence.rglob("*") if p.is_file() and p.parts[-3:-1] != ("models", "actor")
                 and "models" in p.parts)  # a model file: not in the part a partial copy must hold
    victim.unlink()
    with pytest.raises(EvidenceError) as caught:
        Acceptance.load(acc, evidence)
    assert str(caught.value) == (f"reference evidence does not match {acc}: 1 missing, 0 extra, 0 modified "
                                 "(run 'qualify verify')")
    assert Acceptance.load(acc, evidence, partial=True).families  # a subset by design: missing files allowed
    (evidence / "matrix" / "_complete.json").unlink()  # but the snapshot the rule is traced to must be there
    with pytest.raises(EvidenceError, match="the matrix snapshot .* is not sealed here"):
        Acceptance.load(acc, evidence, partial=True)


def test_load_names_a_missing_acceptance(tmp_path):
    with pytest.raises(EvidenceError) as caught:
        Acceptance.load(tmp_path / "nothing.json")
    assert str(caught.value) == f"no acceptance at {tmp_path / 'nothing.json'} (run 'qualify freeze' first)"


@pytest.mark.parametrize("drop, changes", [((), {"schema_version": "qualify.manifest/1"}), (("bounds",), {}),
                                           ((), {"bounds": ["actor-fp32-repeat.json"]})])
def test_load_refuses_another_schema_or_no_bounds_in_full(acc, frozen, drop, changes):
    rewrite(acc, drop, **changes)
    with pytest.raises(ManifestError) as caught:
        Acceptance.load(acc, frozen.reference)
    assert str(caught.value) == (f"{acc}: not an acceptance manifest (no '{ACCEPTANCE_SCHEMA}' schema or no "
                                 "'bounds'; 'qualify freeze' writes one, 'qualify manifest create' does not)")


# --- accessors and require_rollout -------------------------------------------------------------------------------

def test_bound_bounds_and_reference_run_read_their_family():
    families = {("actor", "fp32-repeat"): {"reference_run": "fp32-r0",
                                           "bounds": {"step0/grads/w": {"max_abs": {"bound": 2}}}},
                ("critic", "fp32-repeat"): {"reference_run": "bf16-r0",
                                            "bounds": {"step0/grads/w": {"max_abs": {"bound": 3}}}},
                ("actor", "bf16-repeat"): {"reference_run": "bf16-r1",
                                           "bounds": {"step0/grads/w": {"max_abs": {"bound": 5}}}}}
    acc = Acceptance(None, {}, families)
    assert acc.bounds("critic", "fp32-repeat") == {"step0/grads/w": {"max_abs": {"bound": 3}}}
    got = [acc.bound(r, f, "step0/grads/w", "max_abs") for r, f in families]
    assert got == [2.0, 3.0, 5.0] and all(type(b) is float for b in got)
    assert [acc.reference_run(r, f) for r, f in families] == ["fp32-r0", "bf16-r0", "bf16-r1"]


def test_the_frozen_bounds_are_the_bound_files(frozen):
    loaded = Acceptance.load(frozen.acceptance)
    file = read_json(frozen.acceptance_dir / "bounds" / "critic-bf16-repeat.json")
    key = min(file["bounds"])
    metric = min(file["bounds"][key])
    assert loaded.bound("critic", "bf16-repeat", key, metric) == file["bounds"][key][metric]["bound"]
    assert loaded.reference_run("critic", "bf16-repeat") == file["reference_run"]


def test_require_rollout_takes_the_frozen_rollout_and_names_another(frozen):
    """The synthetic TP1 rollout is the frozen one; TP2's has its own digest."""
    loaded = Acceptance.load(frozen.acceptance)
    loaded.require_rollout(frozen.rollout(1))
    for other in (frozen.rollout(2), frozen.root / "no-such-rollout"):
        with pytest.raises(EvidenceError) as caught:
            loaded.require_rollout(other)
        assert str(caught.value) == f"rollout at {other} is not the one the acceptance froze ({loaded.rollout_digest})"


# --- check_acceptance --------------------------------------------------------------------------------------------

def test_a_grpo_acceptance_needs_the_actor_bound_files_alone(acc):
    d = read_json(acc)
    actor = {n: v for n, v in d["bounds"].items() if n.startswith("actor-")}
    rewrite(acc, algorithm="grpo", bounds=actor)
    assert check_acceptance(acc) == []
    rewrite(acc, algorithm="ppo")
    [problem] = check_acceptance(acc)
    assert problem.startswith("bound files ['actor-bf16-repeat.json', ") and "'critic-bf16-repeat.json'" in problem


def test_an_acceptance_without_a_rule_is_a_problem_per_bound_file(acc):
    rewrite(acc, ("rule",))
    problems = check_acceptance(acc)
    names = sorted(read_json(acc)["bounds"])
    assert problems == [p for n in names for p in (
        f"{n}: k, floors or floor_ulps differ from the acceptance's rule",
        f"{n}: the acceptance has no rule (k and floors) to check its bounds against")]


# --- check_bounds ------------------------------------------------------------------------------------------------

RULE = {"k": 3.0, "floors": {"grad": 0.25}, "quantum": True}


def entry(kind="grad", error=0.125, floor=0.25, quantum=0.0, **extra) -> dict:
    return {"kind": kind, "control_error": error, "floor": floor, "quantum": quantum,
            "bound": 3.0 * error + floor + quantum, **extra}


def bounds_doc(bounds, **rule) -> dict:
    return {"schema": BOUNDS_SCHEMA, "k": 3.0, "floors": {"grad": 0.25}, **rule, "bounds": bounds}


@pytest.mark.parametrize("rule", [{"k": 3.0}, {"k": 3.0, "floors": [0.25]}, {"floors": {"grad": 0.25}},
                                  {"k": "3", "floors": {"grad": 0.25}}])
def test_a_rule_without_k_or_floors_stops_the_check(rule):
    doc = bounds_doc({"grads/w": {"max_abs": entry()}})
    problems = check_bounds(doc, rule, "f.json")
    assert problems[-1] == "f.json: the acceptance has no rule (k and floors) to check its bounds against"
    assert problems[:-1] == ["f.json: k, floors or floor_ulps differ from the acceptance's rule"]


def test_an_unknown_kind_is_named_and_the_next_metric_still_checked():
    doc = bounds_doc({"grads/w": {"max_abs": entry(kind="nonsense"), "rel_l2": entry(floor=0.5)}})
    assert check_bounds(doc, RULE, "f.json") == [
        "f.json: grads/w max_abs: kind 'nonsense' has no floor in the rule",
        "f.json: grads/w rel_l2: floor 0.5 is not the rule's grad floor 0.25"]
    missing = bounds_doc({"grads/w": {"max_abs": {k: v for k, v in entry().items() if k != "kind"}}})
    assert check_bounds(missing, RULE, "f.json") == ["f.json: grads/w max_abs: kind None has no floor in the rule"]


def test_a_per_tensor_floor_without_floor_ulps_in_the_rule_is_the_kinds_floor():
    """A magnitude of 2**30 has an fp32 ulp of 128: any floor_ulps would lift the floor far above 0.25."""
    doc = {"schema": BOUNDS_SCHEMA, "k": 3.0, "floors": {"grad": 0.25},
           "bounds": {"grads/w": {"max_abs": entry(magnitude=2.0 ** 30)}}}
    assert check_bounds(doc, RULE, "f.json") == []
    lifted = {"schema": BOUNDS_SCHEMA, "k": 3.0, "floors": {"grad": 0.25}, "floor_ulps": 1.0,
              "bounds": {"grads/w": {"max_abs": entry(floor=128.0, magnitude=2.0 ** 30)}}}
    assert check_bounds(lifted, RULE | {"floor_ulps": 1.0}, "f.json") == []
    assert check_bounds(lifted | {"floor_ulps": 0.0}, RULE | {"floor_ulps": 0.0}, "f.json") == [
        "f.json: grads/w max_abs: floor 128.0 is not the rule's grad floor 0.25"]


# --- read_snapshot -----------------------------------------------------------------------------------------------

def test_a_malformed_snapshot_is_named_by_its_path(tmp_path):
    path = tmp_path / "matrix.json"
    write_json(path, {"name": "x", "nonsense": 1})
    with pytest.raises(MatrixError) as caught:
        read_snapshot(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_load_refuses_an_acceptance_frozen_under_an_earlier_rule(acc, frozen):
    """Named with its path, its schema and the one this qualify reads (the advice between may be reworded)."""
    older = "qualify.acceptance/0"
    rewrite(acc, schema_version=older)
    with pytest.raises(ManifestError) as caught:
        Acceptance.load(acc, frozen.reference)
    message = str(caught.value)
    assert message.startswith(f"{acc}: frozen under an earlier rule ({older}; this qualify reads {ACCEPTANCE_SCHEMA}): ")
    assert "freeze" in message.split("): ", 1)[1] and message.endswith("for a committed one)")
