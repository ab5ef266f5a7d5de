"""reference.layer_activations: false leaves step 1's per-layer activations out of a reference run (2.7 GB of each r0
run at Qwen3-0.6B) without changing a scored number, and diagnose's refusal then names the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qualify.bounds.files import layer_bounds_named
from qualify.errors import EvidenceError
from qualify.layout import RunLayout
from qualify.matrix import load_matrix
from qualify.models import hf
from qualify.models.tiny import build_tiny_model
from qualify.reference.context import ScoringContext
from qualify.reference.evidence import scoring_settings
from qualify.reference.step import Control, run_role
from tests.unit.reference.test_step_offload import _inputs


def _matrix(layers: bool):
    m = load_matrix("matrices/tiny-qwen3.yaml")
    return dataclasses.replace(m, reference=dataclasses.replace(m.reference, device="cpu", layer_activations=layers))


def test_without_layer_activations_the_scored_evidence_is_bitwise_the_same(tmp_path):
    spec = _matrix(True).models.tiny
    build_tiny_model(spec, "actor").save_pretrained(tmp_path)
    batch, targets = _inputs(spec.vocab_size)
    results = {}
    for layers in (True, False):
        master = hf.load_model(tmp_path, "actor")
        with torch.enable_grad():
            results[layers] = run_role(ScoringContext.of(_matrix(layers), RunLayout(tmp_path), "sha256:r", "sha256:t"), "actor", "fp32", Control(name="r0"), master, batch, targets,
                                       spec.vocab_size, tmp_path)
    assert results[True]["layers"] and "layers" not in results[False]
    for a, b in zip(results[True]["steps"], results[False]["steps"]):
        for group in ("outputs", "grads", "updates", "moments"):
            assert a[group].keys() == b[group].keys()
            assert all(torch.equal(a[group][n], b[group][n]) for n in a[group]), group
    # nothing scored changes, so the fingerprint a stage is reused under does not either
    assert scoring_settings(_matrix(True), "sha256:x") == scoring_settings(_matrix(False), "sha256:x")


def test_diagnose_names_the_field_when_the_acceptance_has_no_layer_bounds(tmp_path):
    with pytest.raises(EvidenceError, match="reference.layer_activations: false"):
        layer_bounds_named(tmp_path / "acceptance.json", {"layer_bounds": {}})


def test_what_the_reference_keeps_of_its_controls_is_not_in_the_fingerprint():
    m = _matrix(True)
    full = dataclasses.replace(m, reference=dataclasses.replace(m.reference, evidence="full"))
    assert scoring_settings(m, "sha256:x") == scoring_settings(full, "sha256:x")
    other = dataclasses.replace(m, reference=dataclasses.replace(m.reference, logprob_chunk_tokens=16))
    assert scoring_settings(m, "sha256:x") != scoring_settings(other, "sha256:x")  # a numerics field still is
