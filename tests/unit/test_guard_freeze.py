"""qualify.freeze, what mutation testing found unpinned (TESTING.md, run G).

Most tests call freeze's parts directly on small inputs (a whole freeze of the synthetic reference takes seconds,
and mutation testing runs every test that calls a mutated function once per mutant).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from qualify.bounds.rule import FAMILIES, RULE, BoundRule
from qualify.errors import EvidenceError
from qualify.freeze import ACCEPTANCE_SCHEMA, acceptance_document
from qualify.layout import RunLayout
from qualify.store import write_json


def _matrix(algorithm: str = "ppo") -> SimpleNamespace:
    freeze = SimpleNamespace(k=3.0, floors={"grad": 0.25}, floor_ulps=2.0, quantum=True, require=["clip"])
    return SimpleNamespace(name="m", algorithm=algorithm, freeze=freeze)


SUMMARY = {"matrix_digest": "sha256:m", "rollout_digest": "sha256:r", "targets_digest": "sha256:t",
           "versions": {"torch": "x"}, "host": {"name": "h"}, "platform": {"cpu": "p"}, "coverage": {"actor": []},
           "rollout_platform": {"cpu": "q"}, "git": {"commit": None}}


@pytest.fixture
def layout(tmp_path):
    layout = RunLayout(tmp_path / "run")
    write_json(layout.reference / "reference.json", {"x": 1})
    return layout


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_the_acceptance_document_names_rule_digests_and_a_grpo_algorithm(layout, algorithm):
    m = _matrix(algorithm)
    doc = acceptance_document(layout, "n", {"actor-fp32-repeat.json": b"{}"}, SUMMARY, m.name, m.freeze, m.algorithm,
                              {"actor.json": b"[]"})
    assert doc["schema_version"] == ACCEPTANCE_SCHEMA and doc["name"] == "n" and doc["matrix"] == "m"
    assert doc["rule"] == {"text": RULE, "k": 3.0, "floors": {"grad": 0.25}, "floor_ulps": 2.0, "quantum": True,
                           "families": list(FAMILIES)}
    assert doc.get("algorithm") == ("grpo" if algorithm == "grpo" else None)
    assert [e["path"] for e in doc["files"]] == ["reference.json"]


def test_the_acceptance_document_is_built_without_a_progress_bar(layout, monkeypatch):
    import qualify.freeze as freeze_module

    calls = []
    real = freeze_module.build_manifest

    def spy(*args, **kwargs):
        calls.append((args, {k: v for k, v in kwargs.items() if k != "extra"}))
        return real(*args, **kwargs)

    monkeypatch.setattr(freeze_module, "build_manifest", spy)
    m = _matrix()
    acceptance_document(layout, "n", {}, SUMMARY, m.name, m.freeze, m.algorithm)
    assert calls == [((layout.reference,), {"progress": False})]


# --- BoundRule.entry: the per-tensor floor and the magnitude it records -------------------------------------------

FLOORS = {"grad": 0.25, "relative": 0.0625, "update": 0.5}


def test_an_entry_takes_the_per_tensor_floor_of_its_magnitude_and_records_it():
    """floor_ulps 4 at magnitude 2**20 (fp32 ulp 2**-3): an absolute floor of 0.5, above the grad floor 0.25."""
    rule = BoundRule(3.0, FLOORS, 4.0, "fp32", False)
    assert rule.entry("grads/w", "max_abs", 0.125, 2.0 ** 20) == {
        "kind": "grad", "control_error": 0.125, "floor": 0.5, "quantum": 0.0, "bound": 3.0 * 0.125 + 0.5,
        "magnitude": 2.0 ** 20}
    assert rule.entry("grads/w", "max_abs", 0.125, 1.0)["floor"] == 0.25  # 4 ulps of 1: below the kind's floor


def test_a_relative_entry_takes_floor_ulps_relative_steps_whatever_the_magnitude():
    """rel_l2: floor_ulps x 2**-23 (0.125 for 2**20 of them), not the ulp of the magnitude (128 at 2**10)."""
    rule = BoundRule(3.0, FLOORS, 2.0 ** 20, "fp32", False)
    assert rule.entry("grads/w", "rel_l2", 0.25, 2.0 ** 10) == {
        "kind": "relative", "control_error": 0.25, "floor": 0.125, "quantum": 0.0, "bound": 0.75 + 0.125,
        "magnitude": 2.0 ** 10}


# --- step_family_bounds: the update rows (resolved and replayed) ------------------------------------------------

def test_update_rows_take_the_floor_of_the_reference_updates_magnitude(tmp_path):
    """Every updates/ entry (replay_max_abs and, where frozen, the update-vs-reference rows) records the reference run's
    max |update| and, with 2**20 floor_ulps, the per-tensor floor of that magnitude (above the update floor)."""
    from qualify.bounds.control_error import family_bounds
    from qualify.bounds.rule import ulp
    from tests.unit._runs import COEF, FLOORS, OPT, K, params, role_steps, write_steps

    layout = RunLayout(tmp_path)
    steps = {c: role_steps("critic", COEF[("bf16", c)], 1) for c in ("r0", "r1")}
    for control, run in steps.items():
        write_steps(layout.scores("bf16", control, "critic"), run)
    doc = family_bounds(layout, "critic", "bf16-repeat", ["r0", "r1"], K, FLOORS, params(), OPT, False, 2.0 ** 20)
    updates = {key: ms for key, ms in doc["bounds"].items() if key.startswith("step0/updates/")}
    assert sorted(updates) == ["step0/updates/b", "step0/updates/w"]
    for key, ms in updates.items():
        mag = float(steps["r0"][0].updates[key.rsplit("/", 1)[1]].double().abs().max())
        assert "replay_max_abs" in ms
        for metric, b in ms.items():
            floor = max(FLOORS["update"], 2.0 ** 20 * (2.0 ** -23 if metric == "rel_l2" else ulp("fp32", mag)))
            assert (b["kind"], b["magnitude"], b["floor"]) == ("update", mag, floor), (key, metric)
            assert floor > FLOORS["update"]


def test_family_bounds_without_floor_ulps_keep_the_kinds_floors(tmp_path):
    """Floors of 1e-30 are below one ulp of every tensor: any floor_ulps default but 0 would lift them."""
    from qualify.bounds.control_error import family_bounds
    from tests.unit._runs import COEF, FLOORS, OPT, K, params, role_steps, write_steps

    layout = RunLayout(tmp_path)
    for control in ("r0", "r1"):
        write_steps(layout.scores("bf16", control, "critic"), role_steps("critic", COEF[("bf16", control)], 1))
    tiny = {kind: 1e-30 for kind in FLOORS}
    doc = family_bounds(layout, "critic", "bf16-repeat", ["r0", "r1"], K, tiny, params(), OPT, False)
    assert doc["floor_ulps"] == 0.0
    assert {b["floor"] for ms in doc["bounds"].values() for b in ms.values()} == {1e-30}


# --- verified_reference ------------------------------------------------------------------------------------------

def test_a_malformed_sealed_snapshot_is_named_by_its_stage(tmp_path):
    """A snapshot sealed (and named by the summary) with a key the matrix schema does not know: the error names the
    snapshot stage, where the matrix came from."""
    import hashlib

    from qualify.errors import MatrixError
    from qualify.freeze import freeze
    from qualify.stages import complete_stage, prepare_stage
    from qualify.store import read_json
    from tests.unit._runs import synthetic_matrix, synthetic_reference

    layout = synthetic_reference(tmp_path / "run", synthetic_matrix(tmp_path))
    snapshot = read_json(layout.matrix_snapshot / "matrix.json") | {"nonsense": 1}
    (layout.matrix_snapshot / "_complete.json").unlink()  # unsealed, then sealed again with the edited matrix
    prepare_stage(layout.matrix_snapshot)
    write_json(layout.matrix_snapshot / "matrix.json", snapshot)
    digest = "sha256:" + hashlib.sha256((layout.matrix_snapshot / "matrix.json").read_bytes()).hexdigest()
    complete_stage(layout.matrix_snapshot, {"digest": digest})
    write_json(layout.reference_summary, read_json(layout.reference_summary) | {"matrix_digest": digest})
    with pytest.raises(MatrixError) as caught:
        freeze(layout.root)
    assert str(caught.value).startswith(f"{layout.matrix_snapshot}: unknown key 'nonsense'")


# --- a GRPO reference: the actor alone -----------------------------------------------------------------------------

def test_a_grpo_reference_freezes_the_actor_alone(tmp_path):
    """The synthetic reference also holds critic scores: a GRPO freeze must read and record the actor's alone
    (coverage, bound files) and mark the acceptance 'grpo', which check_acceptance then holds to the actor's files."""
    import yaml

    from qualify.acceptance import check_acceptance
    from qualify.freeze import freeze
    from qualify.matrix import load_matrix
    from tests.unit import _runs

    data = yaml.safe_load((_runs.REPO / "matrices" / "tiny-qwen3-grpo.yaml").read_text())
    data["freeze"] = {"k": _runs.K, "floors": _runs.FLOORS, "require": []}
    data["reference"] |= {"repeats": len(_runs.CONTROLS), "perturbations": []}
    data["optimizer"] = {"lr": _runs.OPT.lr, "betas": list(_runs.OPT.betas), "eps": _runs.OPT.eps,
                         "weight_decay": _runs.OPT.weight_decay, "max_grad_norm": _runs.OPT.max_grad_norm}
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(data))
    layout = _runs.synthetic_reference(tmp_path / "run", load_matrix(tmp_path / "grpo.yaml"),
                                       coverage={"actor": [{"clip": 1}], "critic": [{"clip": 2}]})
    doc = freeze(layout.root)
    assert doc["algorithm"] == "grpo" and doc["coverage"] == {"required": [], "steps": {"actor": [{"clip": 1}]}}
    assert sorted(doc["bounds"]) == [f"actor-{family}.json" for family in sorted(FAMILIES)]
    assert check_acceptance(layout.acceptance) == []


def test_freeze_takes_its_controls_from_the_sealed_snapshot_not_the_summary(tmp_path):
    """reference.json is not sealed: a control dropped from its list (the one that sets a bound) must not narrow
    the bounds; freeze refuses a list other than the one the sealed matrix snapshot declares."""
    from qualify.freeze import freeze
    from qualify.store import read_json, write_json
    from tests.unit import _runs

    layout = _runs.synthetic_reference(tmp_path / "run", _runs.synthetic_matrix(tmp_path))
    summary = read_json(layout.reference_summary)
    write_json(layout.reference_summary, summary | {"controls": ["r0", "r2"]})  # r1 sets the fp32-repeat bounds
    with pytest.raises(EvidenceError, match=r"lists controls \['r0', 'r2'\], but the sealed matrix snapshot declares "
                                            r"\['r0', 'r1', 'r2'\]"):
        freeze(layout.root)
    assert not layout.acceptance.exists()
