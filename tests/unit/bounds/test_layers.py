"""Per-layer metrics and the layer bounds freeze writes: against slow loops, on a sealed synthetic reference.

An acceptance frozen from a reference without layer activations has no layer bounds, verifies as before, and
diagnose (library and CLI) says that a new reference and freeze are needed.
"""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from qualify.acceptance import Acceptance, check_acceptance
from qualify.bounds.files import read_layer_bounds
from qualify.bounds.layers import LAYERS_FILE, backward_groups, grad_group, group_metrics, layer_metrics
from qualify.bounds.rule import quantum, tensor_floor
from qualify.diagnose.stage import diagnose
from qualify.errors import EvidenceError
from qualify.freeze import freeze
from qualify.stages import complete_stage, stage_info
from qualify.store import read_json, write_tensors
from tests.unit._runs import COEF, FLOORS, K, synthetic_matrix, synthetic_reference

NAMES = ["model.layers.0.mlp", "model.layers.0", "model.layers.1.self_attn", "model.norm"]


def g(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def activations(coef: float) -> dict[str, torch.Tensor]:
    """A run's activations: a fixed base plus coef x a fixed noise per module (as the synthetic scores are made)."""
    return {n: g(i, 2, 6, 4) + coef * g(100 + i, 2, 6, 4) for i, n in enumerate(NAMES)}


def add_layers(layout) -> None:
    """Give every synthetic scored run its layers.safetensors and seal it again."""
    for (precision, control), coef in COEF.items():
        for role in ("actor", "critic"):
            d = layout.scores(precision, control, role)
            info = stage_info(d)
            write_tensors(d / LAYERS_FILE, activations(coef))
            complete_stage(d, info)


def test_grad_groups_and_backward_order():
    names = ["lm_head.weight", "model.norm.weight", "model.embed_tokens.weight", "model.layers.10.mlp.up_proj.weight",
             "model.layers.2.self_attn.q_norm.weight", "model.layers.2.input_layernorm.weight", "score.weight"]
    assert [grad_group(n) for n in names] == ["head", "head", "model.embed_tokens", "model.layers.10",
                                              "model.layers.2", "model.layers.2", "head"]
    assert backward_groups(names) == ["head", "model.layers.10", "model.layers.2", "model.embed_tokens"]


def test_group_metrics_are_those_of_the_concatenated_group():
    c = {"a": g(1, 3, 4), "b": g(2, 5)}
    r = {"a": g(3, 3, 4), "b": g(4, 5)}
    flat_c, flat_r = torch.cat([c["a"].flatten(), c["b"]]).double(), torch.cat([r["a"].flatten(), r["b"]]).double()
    got = group_metrics(c, r, ["a", "b"])
    diffs = sorted(abs(float(x) - float(y)) for x, y in zip(flat_c, flat_r))
    assert got["max_abs"] == pytest.approx(diffs[-1], rel=1e-12)
    assert got["rel_l2"] == pytest.approx(float((flat_c - flat_r).norm() / flat_r.norm()), rel=1e-12)
    assert got["mean_abs"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-12)
    assert got["p99_abs"] == pytest.approx(diffs[math.ceil(0.99 * len(diffs)) - 1], rel=1e-12)
    c["b"][0] = math.nan
    assert group_metrics(c, r, ["a", "b"]) == dict.fromkeys(("max_abs", "rel_l2", "mean_abs", "p99_abs"), math.inf)


def test_layer_metrics_judge_a_gradient_group_whole_or_not_at_all():
    ref = {"model.layers.0.mlp.up_proj.weight": g(1, 4), "model.layers.0.mlp.down_proj.weight": g(2, 4),
           "model.layers.1.mlp.up_proj.weight": g(3, 4)}
    cand = dict(ref)
    del cand["model.layers.0.mlp.down_proj.weight"]
    acts = {"model.norm": g(5, 2, 3)}
    got = layer_metrics({"model.norm": g(5, 2, 4)}, acts, cand, ref)  # a wrong shape is not measured
    assert set(got) == {"grads/model.layers.1"}
    assert set(layer_metrics(None, acts, ref, ref)) == {"grads/model.layers.0", "grads/model.layers.1"}


def test_freeze_writes_layer_bounds_by_the_rule_and_the_acceptance_names_them(tmp_path):
    layout = synthetic_reference(tmp_path / "run", synthetic_matrix(tmp_path))
    add_layers(layout)
    doc = freeze(layout.root)
    assert set(doc["layer_bounds"]) == {"actor.json", "critic.json"}
    assert check_acceptance(layout.acceptance) == []  # the six per-tensor bound files are unchanged
    acc = Acceptance.load(layout.acceptance, layout.reference)
    bounds = read_layer_bounds(acc.path, acc.document, "actor")
    assert bounds["k"] == K and bounds["floors"] == FLOORS
    expected_runs = {"fp32-repeat": ("fp32", "r0", [("fp32", "r1"), ("fp32", "r2")]),
                     "bf16-repeat": ("bf16", "r0", [("bf16", "r1"), ("bf16", "r2")]),
                     "fp32-vs-bf16": ("fp32", "r0", [("bf16", c) for c in ("r0", "r1", "r2")])}
    for family, (bp, bc, others) in expected_runs.items():
        fam = bounds["families"][family]
        assert fam["reference_run"] == f"{bp}-{bc}"
        base = activations(COEF[(bp, bc)])
        precision = "fp32" if family == "fp32-repeat" else "bf16"
        for name in NAMES:
            worst = 0.0
            for run in others:  # slow loop: the largest control error of the family
                other = activations(COEF[run])
                worst = max(worst, max(abs(float(x) - float(y)) for x, y in zip(other[name].flatten(),
                                                                                  base[name].flatten())))
            entry = fam["bounds"][f"act/{name}"]["max_abs"]
            magnitude = float(base[name].abs().max())
            q = quantum(precision, "max_abs", magnitude) if precision == "bf16" else 0.0  # bf16 activations only
            floor = tensor_floor("value", "max_abs", magnitude, FLOORS, bounds["floor_ulps"])
            assert entry["control_error"] == pytest.approx(worst, rel=1e-6)
            assert entry["bound"] == pytest.approx(K * worst + floor + q, rel=1e-9)
            assert fam["bounds"][f"act/{name}"]["rel_l2"]["floor"] >= FLOORS["relative"]
            assert set(fam["bounds"][f"act/{name}"]) == {"max_abs", "rel_l2", "mean_abs", "p99_abs"}
        assert fam["bounds"]["grads/head"]["max_abs"]["floor"] >= FLOORS["grad"]


def test_a_layer_bound_file_that_changed_is_refused(tmp_path):
    layout = synthetic_reference(tmp_path / "run", synthetic_matrix(tmp_path))
    add_layers(layout)
    freeze(layout.root)
    acc = Acceptance.load(layout.acceptance, layout.reference)
    file = layout.acceptance_dir / "layers" / "critic.json"
    file.write_text(file.read_text().replace('"k": 3.0', '"k": 30.0'))
    with pytest.raises(EvidenceError, match="critic.json is missing or does not match"):
        read_layer_bounds(acc.path, acc.document, "critic")


def test_acceptance_without_layer_bounds_verifies_and_diagnose_asks_for_a_refreeze(tmp_path):
    from qualify.cli.app import app

    layout = synthetic_reference(tmp_path / "run", synthetic_matrix(tmp_path))
    doc = freeze(layout.root)
    assert "layer_bounds" not in doc and not (layout.acceptance_dir / "layers").exists()
    assert check_acceptance(layout.acceptance) == []
    assert "layer_bounds" not in read_json(layout.acceptance)
    with pytest.raises(EvidenceError, match="has no layer bounds .*reference.layer_activations: false.*into a new run "
                                            "directory and 'qualify freeze' it"):
        diagnose(layout.root, "torch-tp-fp32-tp1-actor")
    result = CliRunner().invoke(app, ["diagnose", str(layout.root), "--case", "torch-tp-fp32-tp1-actor"])
    assert result.exit_code == 2, result.output
    assert "has no layer bounds" in result.output and "Traceback" not in result.output


def test_diagnose_of_an_unknown_case_names_the_known_ones(tmp_path):
    from qualify.cli.app import app

    layout = synthetic_reference(tmp_path / "run", synthetic_matrix(tmp_path))
    add_layers(layout)
    freeze(layout.root)
    result = CliRunner().invoke(app, ["diagnose", str(layout.root), "--case", "nope"])
    assert result.exit_code == 2 and "no case 'nope'" in result.output and "run 'qualify candidate' first" in result.output


def test_a_case_run_against_another_acceptance_is_refused(tmp_path):
    from qualify.case.launch import write_spec_file
    from qualify.case.spec import make_spec
    from qualify.stages import prepare_stage

    matrix = synthetic_matrix(tmp_path)
    layout = synthetic_reference(tmp_path / "run", matrix)
    add_layers(layout)
    freeze(layout.root)
    case = matrix.cases()[0]
    write_spec_file(make_spec(matrix.case_settings, case, model_dir=layout.model(case.role), rollout_dir=layout.rollout(1),
                              targets_dir=layout.targets, rollout_digest="r", targets_digest="t",
                              case_dir=layout.case(case.name), vocab_size=64, device="cpu"))
    prepare_stage(layout.case(case.name))
    complete_stage(layout.case(case.name), {"key": {"acceptance": "sha256:old"}})
    with pytest.raises(EvidenceError, match=f"case {case.name} was run against acceptance sha256:old"):
        diagnose(layout.root, case.name)
