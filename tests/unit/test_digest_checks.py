"""The digest checks themselves, each made to fire on evidence that gets past every earlier guard.

A rollout or targets directory replaced by another one that is sealed just as well passes the stage
marker (and a manifest made of it); only the comparison with the digest the acceptance froze sees
the swap. Each test shows the earlier guard passing first, then the digest check refusing.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from qualify.candidate.stage import run_candidates
from qualify.candidate.worker import run_case
from qualify.case.spec import make_spec
from qualify.errors import EvidenceError
from qualify.freeze import freeze
from qualify.layout import RunLayout
from qualify.manifest import digest_of, load_manifest, verify_manifest
from qualify.reference.evidence import load_targets
from qualify.rollout.capture import load_rollout
from qualify.stages import stage_is_complete
from qualify.store import read_json, write_json
from tests.unit._runs import rollout_tensors, sealed_file_stage, synthetic_matrix, synthetic_reference

OTHER = "sha256:" + "0" * 64


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_load_rollout_returns_the_rollout_with_the_expected_digest(tmp_path):
    digest = sealed_file_stage(tmp_path / "tp1", "rollout.safetensors", rollout_tensors(0))
    assert_same(load_rollout(tmp_path / "tp1", digest), rollout_tensors(0))
    assert_same(load_rollout(tmp_path / "tp1"), rollout_tensors(0))  # no expectation: completeness only


def test_a_rollout_swapped_for_another_sealed_one_is_refused_by_its_digest(tmp_path):
    frozen = sealed_file_stage(tmp_path / "tp1", "rollout.safetensors", rollout_tensors(0))
    shutil.rmtree(tmp_path / "tp1")
    other = sealed_file_stage(tmp_path / "tp1", "rollout.safetensors", rollout_tensors(1))
    assert other != frozen and stage_is_complete(tmp_path / "tp1")  # the stage marker is satisfied
    with pytest.raises(EvidenceError, match=f"has digest {other}, expected {frozen}: refusing to run"):
        load_rollout(tmp_path / "tp1", frozen)


def test_load_targets_checks_the_digest(tmp_path):
    layout = RunLayout(tmp_path)
    frozen = sealed_file_stage(layout.targets, "targets.safetensors", {"returns_BT": torch.ones(2, 3)})
    assert_same(load_targets(layout, frozen), {"returns_BT": torch.ones(2, 3)})
    shutil.rmtree(layout.targets)
    other = sealed_file_stage(layout.targets, "targets.safetensors", {"returns_BT": torch.zeros(2, 3)})
    assert stage_is_complete(layout.targets)
    with pytest.raises(EvidenceError, match=f"has digest {other}, expected {frozen}: refusing to run on a different targets"):
        load_targets(layout, frozen)


# --- the candidate stage and its worker --------------------------------------------------------------------------

@pytest.fixture
def frozen_run(tmp_path):
    matrix = synthetic_matrix(tmp_path)
    layout = synthetic_reference(tmp_path / "run", matrix)
    freeze(layout.root)
    return matrix, layout


def spec_for(matrix, layout: RunLayout, tmp_path, rollout_digest: str, targets_digest: str):
    case = matrix.cases()[0]
    return make_spec(matrix.case_settings, case, model_dir=layout.model(case.role), rollout_dir=layout.rollout(1),
                     targets_dir=layout.targets, rollout_digest=rollout_digest, targets_digest=targets_digest,
                     case_dir=tmp_path / "case", vocab_size=64, device="cpu")


def test_worker_refuses_a_rollout_other_than_the_frozen_one(frozen_run, tmp_path):
    matrix, layout = frozen_run
    doc = read_json(layout.acceptance)
    spec = spec_for(matrix, layout, tmp_path, OTHER, doc["targets_digest"])
    with pytest.raises(EvidenceError, match=f"expected {OTHER}: refusing to run on a different rollout"):
        run_case(spec, 0)
    assert not (tmp_path / "case").exists()


def test_worker_refuses_targets_other_than_the_frozen_ones(frozen_run, tmp_path):
    matrix, layout = frozen_run
    doc = read_json(layout.acceptance)
    spec = spec_for(matrix, layout, tmp_path, doc["rollout_digest"], OTHER)
    with pytest.raises(EvidenceError, match=f"targets .*targets.safetensors do not have the frozen digest {OTHER}"):
        run_case(spec, 0)
    assert not (tmp_path / "case").exists()


def test_candidate_stage_refuses_an_acceptance_that_froze_another_rollout(frozen_run):
    """An acceptance whose manifest matches the evidence file for file, with its own digest intact,
    but which names another rollout: only the rollout digest check catches it."""
    matrix, layout = frozen_run
    doc = read_json(layout.acceptance)
    doc["rollout_digest"] = OTHER
    doc["digest"] = digest_of(doc)
    other = layout.acceptance_dir / "other-acceptance.json"
    write_json(other, doc)
    assert load_manifest(other)["rollout_digest"] == OTHER  # its own digest holds
    assert verify_manifest(other, layout.reference, progress=False).ok  # and every file matches
    with pytest.raises(EvidenceError, match=f"is not the one the acceptance froze \\({OTHER}\\)"):
        run_candidates(matrix, layout.root, acceptance=other, only="no-such-case").to_json()


def test_candidate_stage_refuses_a_bound_file_other_than_the_frozen_one(frozen_run):
    matrix, layout = frozen_run
    bound = layout.bounds / "critic-bf16-repeat.json"
    doc = read_json(bound)
    doc["k"] = 40.0
    write_json(bound, doc)
    assert verify_manifest(layout.acceptance, layout.reference, progress=False).ok  # bounds lie outside the evidence
    with pytest.raises(EvidenceError, match="critic-bf16-repeat.json is missing or does not match"):
        run_candidates(matrix, layout.root, only="no-such-case").to_json()
