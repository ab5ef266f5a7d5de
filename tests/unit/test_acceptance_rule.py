"""qualify.acceptance: every way an acceptance or a bound file can break the rule is named, and nothing else is.

check_bounds runs on bound documents written here; check_acceptance on a synthetic reference frozen by
qualify.freeze (tests/unit/_runs.py), edited the way a hand edit would, with the acceptance's own
digest recomputed so that only the check under test can see the edit.
"""

from __future__ import annotations

import hashlib
import shutil

import pytest

from qualify.acceptance import FROZEN_SECTIONS, check_acceptance, frozen_field_differences, require_sound
from qualify.bounds.check import check_bounds
from qualify.bounds.rule import BOUNDS_SCHEMA
from qualify.errors import ManifestError
from qualify.freeze import ACCEPTANCE_SCHEMA, freeze
from qualify.manifest import digest_of
from qualify.store import read_json, write_json
from tests.unit._runs import synthetic_matrix, synthetic_reference

RULE = {"k": 3.0, "floors": {"grad": 0.25, "relative": 0.5}, "quantum": True}


def entry(kind="grad", error=0.125, floor=0.25, quantum=2.0 ** -10, bound=None) -> dict:
    return {"kind": kind, "control_error": error, "floor": floor, "quantum": quantum,
            "bound": 3.0 * error + floor + quantum if bound is None else bound}


def doc(**entries) -> dict:
    return {"schema": BOUNDS_SCHEMA, "k": 3.0, "floors": RULE["floors"],
            "bounds": {"grads/w": {"max_abs": entry()}, **entries}}


def test_a_sound_bound_file_has_no_problem():
    assert check_bounds(doc(**{"grads/b": {"rel_l2": entry("relative", 0.0, 0.5, 0.0)}}), RULE, "f.json") == []


@pytest.mark.parametrize("change, problem", [
    ({"schema": "qualify.bounds/0"}, "f.json: schema 'qualify.bounds/0'"),
    ({"k": 4.0}, "f.json: k, floors or floor_ulps differ from the acceptance's rule"),
    ({"floors": {"grad": 0.25, "relative": 0.75}}, "f.json: k, floors or floor_ulps differ from the acceptance's rule"),
])
def test_a_bound_file_with_another_schema_or_rule(change, problem):
    assert check_bounds(doc() | change, RULE, "f.json") == [problem]


@pytest.mark.parametrize("bad, problem", [
    (entry(floor=0.5, bound=3 * 0.125 + 0.5 + 2.0 ** -10), "f.json: grads/x max_abs: floor 0.5 is not the rule's grad floor 0.25"),
    (entry(quantum=-1.0, bound=3 * 0.125 + 0.25 - 1.0), "f.json: grads/x max_abs: quantum -1.0 not allowed by the rule"),
    (entry(bound=2 * (3 * 0.125 + 0.25 + 2.0 ** -10)),
     (f"f.json: grads/x max_abs: bound {2 * (3 * 0.125 + 0.25 + 2.0 ** -10)} != k*error+floor+quantum = "
     f"{3 * 0.125 + 0.25 + 2.0 ** -10}")),
    (entry(error=float("inf"), bound=float("inf")), "f.json: grads/x max_abs: bound inf != k*error+floor+quantum = inf"),
])
def test_each_broken_entry_is_named(bad, problem):
    assert check_bounds(doc(**{"grads/x": {"max_abs": bad}}), RULE, "f.json") == [problem]


def test_a_quantum_the_rule_does_not_allow():
    assert check_bounds(doc(), RULE | {"quantum": False}, "f.json") == [
        f"f.json: grads/w max_abs: quantum {2.0 ** -10} not allowed by the rule"]
    assert check_bounds(doc(**{"grads/w": {"max_abs": entry(quantum=0.0)}}), {k: v for k, v in RULE.items()
                                                                            if k != "quantum"}, "f.json") == []


def test_the_bound_is_recomputed_to_a_relative_1e12():
    exact = 3 * 0.125 + 0.25 + 2.0 ** -10
    assert check_bounds(doc(**{"grads/w": {"max_abs": entry(bound=exact * (1 + 1e-13))}}), RULE, "f.json") == []
    assert check_bounds(doc(**{"grads/w": {"max_abs": entry(bound=exact * (1 + 1e-11))}}), RULE, "f.json") != []


# --- check_acceptance on a frozen synthetic reference ----------------------------------------------------------------

@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc")
    layout = synthetic_reference(root / "run", synthetic_matrix(root))
    freeze(layout.root)
    return layout


@pytest.fixture
def acc(frozen, tmp_path):
    """A private copy of the frozen acceptance directory: acceptance.json and bounds/."""
    shutil.copytree(frozen.acceptance_dir, tmp_path / "acceptance")
    return tmp_path / "acceptance" / "acceptance.json"


def rewrite(acc, **changes):
    """Change the acceptance and re-digest it (a consistent hand edit: its own digest holds)."""
    d = read_json(acc) | changes
    d["digest"] = digest_of(d)
    write_json(acc, d)


def redigest_bounds(acc, name):
    d = read_json(acc)
    bounds = dict(d["bounds"])
    bounds[name] = "sha256:" + hashlib.sha256((acc.parent / "bounds" / name).read_bytes()).hexdigest()
    rewrite(acc, bounds=bounds)


def test_the_frozen_acceptance_is_sound(acc):
    assert check_acceptance(acc) == []
    require_sound(acc)


def test_another_schema_version(acc):
    rewrite(acc, schema_version="qualify.acceptance/0")
    assert check_acceptance(acc) == [f"schema_version 'qualify.acceptance/0' != {ACCEPTANCE_SCHEMA!r}"]


def test_a_bound_file_missing_from_the_list(acc):
    bounds = dict(read_json(acc)["bounds"])
    del bounds["critic-bf16-repeat.json"]
    rewrite(acc, bounds=bounds)
    [problem] = check_acceptance(acc)
    assert problem.startswith("bound files ['actor-bf16-repeat.json'") and "'critic-bf16-repeat.json'" in \
        problem.split("!=")[1] and "'critic-bf16-repeat.json'" not in problem.split("!=")[0]


def test_a_missing_bound_file(acc):
    (acc.parent / "bounds" / "actor-fp32-vs-bf16.json").unlink()
    assert check_acceptance(acc) == [f"missing bound file {acc.parent / 'bounds' / 'actor-fp32-vs-bf16.json'}"]


def test_an_edited_bound_file(acc):
    file = acc.parent / "bounds" / "critic-fp32-repeat.json"
    file.write_text(file.read_text() + " ")
    assert check_acceptance(acc) == [f"bound file {file} does not match the acceptance's digest"]


def test_a_bound_file_re_digested_after_widening_still_breaks_the_rule(acc):
    file = acc.parent / "bounds" / "actor-bf16-repeat.json"
    d = read_json(file)
    key = min(d["bounds"])
    metric = min(d["bounds"][key])
    d["bounds"][key][metric]["bound"] *= 2
    write_json(file, d)
    redigest_bounds(acc, "actor-bf16-repeat.json")
    [problem] = check_acceptance(acc)
    assert problem.startswith(f"actor-bf16-repeat.json: {key} {metric}: bound ")


def test_a_rule_changed_in_the_acceptance_is_caught_in_every_bound_file(acc):
    rule = read_json(acc)["rule"]
    rewrite(acc, rule=rule | {"k": rule["k"] * 2})
    problems = check_acceptance(acc)
    assert sum("k, floors or floor_ulps differ" in p for p in problems) == 6


def break_schemas(acc, count: int) -> list[str]:
    """Give `count` bound files another schema (re-digested): one problem each."""
    d = read_json(acc)
    bounds = dict(d["bounds"])
    for name in sorted(bounds)[:count]:
        file = acc.parent / "bounds" / name
        write_json(file, read_json(file) | {"schema": "qualify.bounds/0"})
        bounds[name] = "sha256:" + hashlib.sha256(file.read_bytes()).hexdigest()
    rewrite(acc, bounds=bounds)
    return check_acceptance(acc)


@pytest.mark.parametrize("count, ellipsis", [(5, ""), (6, " ...")])
def test_require_sound_names_the_first_five_problems(acc, count, ellipsis):
    problems = break_schemas(acc, count)
    assert len(problems) == count and all(p.endswith(": schema 'qualify.bounds/0'") for p in problems)
    with pytest.raises(ManifestError) as caught:
        require_sound(acc)
    assert str(caught.value) == f"{acc}: " + "; ".join(problems[:5]) + ellipsis


def test_frozen_field_differences_name_each_changed_field():
    snapshot = {"optimizer": {"lr": 1e-3, "betas": [0.9, 0.999]}, "freeze": {"k": 4.0, "floors": {"grad": 1e-6}},
                "candidates": {"engines": ["torch-tp"]}, "rollout": {"seed": 1}}
    live = {"optimizer": {"lr": 2e-3, "betas": [0.9, 0.999]}, "freeze": {"k": 4.0, "floors": {"grad": 1e-6, "x": 1}},
            "candidates": {"engines": ["deepspeed"]}, "ppo": {"epochs": 2}, "rollout": {"seed": 1}}
    assert frozen_field_differences(snapshot, live) == [
        "ppo: None (frozen) != {'epochs': 2}", "optimizer.lr: 0.001 (frozen) != 0.002",
        "freeze.floors.x: None (frozen) != 1"]
    assert frozen_field_differences(snapshot, snapshot) == []
    assert "candidates" not in FROZEN_SECTIONS


def test_a_bound_file_without_entries_and_a_rule_without_its_quantum_flag():
    assert check_bounds({"schema": BOUNDS_SCHEMA, "k": 3.0, "floors": RULE["floors"]}, RULE, "f.json") == []
    no_flag = {k: v for k, v in RULE.items() if k != "quantum"}  # an acceptance that does not allow a quantum
    assert check_bounds(doc(), no_flag, "f.json") == [(f"f.json: grads/w max_abs: quantum {2.0 ** -10} not allowed "
                                                      "by the rule")]


def test_an_acceptance_without_bound_files_is_named(acc):
    d = {k: v for k, v in read_json(acc).items() if k != "bounds"}
    d["digest"] = digest_of(d)
    write_json(acc, d)
    [problem] = check_acceptance(acc)
    assert problem.startswith("bound files [] != ['actor-bf16-repeat.json', ")


def test_every_bound_file_is_checked_after_a_missing_one(acc):
    (acc.parent / "bounds" / "actor-bf16-repeat.json").unlink()  # first in sorted order
    edited = acc.parent / "bounds" / "critic-fp32-vs-bf16.json"  # last
    edited.write_text(edited.read_text() + " ")
    stale = acc.parent / "bounds" / "actor-fp32-repeat.json"
    stale.write_text(stale.read_text() + " ")
    assert check_acceptance(acc) == [f"missing bound file {acc.parent / 'bounds' / 'actor-bf16-repeat.json'}",
                                     f"bound file {stale} does not match the acceptance's digest",
                                     f"bound file {edited} does not match the acceptance's digest"]


def test_a_snapshot_sealed_before_a_field_existed_holds_its_default(tmp_path):
    """A field added to the schema after a reference was sealed (freeze.floor_ulps here) reads as its default, so the
    unchanged matrix still matches; setting it to anything else is still a change of a frozen field."""
    import dataclasses

    from qualify.acceptance import read_snapshot
    from qualify.matrix import load_matrix
    from qualify.schema import to_dict
    from qualify.store import write_json

    matrix = load_matrix("matrices/tiny-qwen3.yaml")
    old = to_dict(matrix)
    del old["freeze"]["floor_ulps"]
    write_json(tmp_path / "matrix.json", old)
    assert frozen_field_differences(read_snapshot(tmp_path / "matrix.json"), to_dict(matrix)) == []
    changed = dataclasses.replace(matrix, freeze=dataclasses.replace(matrix.freeze, floor_ulps=8.0))
    assert frozen_field_differences(read_snapshot(tmp_path / "matrix.json"), to_dict(changed)) == [
        "freeze.floor_ulps: 4.0 (frozen) != 8.0"]
