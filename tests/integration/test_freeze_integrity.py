"""freeze seals only a whole, untampered reference, with the rule of the matrix it started from; the candidate
stage only runs the matrix that was frozen."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from qualify.candidate.stage import run_candidates
from qualify.errors import EvidenceError, QualifyError
from qualify.freeze import freeze
from qualify.layout import RunLayout
from qualify.store import read_json, write_json
from tests.integration._support import matrix_with

pytestmark = [pytest.mark.vllm]


def without_acceptance(run_copy):
    layout = RunLayout(run_copy)
    shutil.rmtree(layout.acceptance_dir)
    return layout


@pytest.mark.parametrize("victim", ["targets/targets.safetensors", "rollout/tp2/rollout.safetensors",
                                    "models/critic/model.safetensors", "scores/bf16-r1/actor/step2/outputs.safetensors",
                                    "scores/bf16-r1/actor/control-errors.json",
                                    "scores/fp32-r0/actor/step2/grads.safetensors"])
def test_refreeze_refuses_tampered_evidence_anywhere_in_the_reference(run_copy, victim):
    layout = without_acceptance(run_copy)
    path = layout.reference / victim
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(EvidenceError, match="missing, partial or modified"):
        freeze(run_copy)
    assert not layout.acceptance.exists()


@pytest.mark.parametrize("victim", ["targets", "rollout/tp2"])
def test_refreeze_refuses_a_missing_stage(run_copy, victim):
    layout = without_acceptance(run_copy)
    shutil.rmtree(layout.reference / victim)
    with pytest.raises(EvidenceError, match="missing, partial or modified"):
        freeze(run_copy)


def test_the_rule_comes_from_the_sealed_snapshot_not_reference_json(run_copy):
    layout = RunLayout(run_copy)
    frozen = layout.acceptance.read_bytes()
    summary = read_json(layout.reference_summary)
    summary["matrix"]["freeze"]["k"] = 1000.0  # reference.json is not sealed: editing it must change nothing
    write_json(layout.reference_summary, summary)
    shutil.rmtree(layout.acceptance_dir)
    freeze(run_copy)
    assert json.loads(layout.acceptance.read_bytes())["rule"]["k"] == json.loads(frozen)["rule"]["k"] == 4.0


def test_a_tampered_snapshot_is_refused(run_copy):
    layout = without_acceptance(run_copy)
    snapshot = layout.matrix_snapshot / "matrix.json"
    snapshot.write_text(snapshot.read_text().replace('"k": 4.0', '"k": 1000.0'))
    with pytest.raises(EvidenceError, match="matrix snapshot"):
        freeze(run_copy)


def test_a_snapshot_changed_and_sealed_again_under_its_old_digest_is_refused(run_copy):
    from qualify.stages import complete_stage, stage_info

    layout = without_acceptance(run_copy)
    snapshot = layout.matrix_snapshot / "matrix.json"
    info = stage_info(layout.matrix_snapshot)
    snapshot.write_text(snapshot.read_text().replace('"k": 4.0', '"k": 1000.0'))
    complete_stage(layout.matrix_snapshot, info)  # every file hashed again, the recorded digest kept
    with pytest.raises(EvidenceError, match="is not the file sealed as .*: it was changed and sealed again"):
        freeze(run_copy)


def test_candidate_refuses_a_matrix_whose_frozen_fields_changed(run_copy, tmp_path):
    m = matrix_with(tmp_path, engines=["torch-tp"])
    changed = dataclasses.replace(m, optimizer=dataclasses.replace(m.optimizer, lr=2 * m.optimizer.lr))
    with pytest.raises(QualifyError, match=r"optimizer\.lr: 0\.0001 \(frozen\) != 0\.0002"):
        run_candidates(changed, run_copy, only="torch-tp-fp32-tp1-actor").to_json()
    assert not RunLayout(run_copy).case("torch-tp-fp32-tp1-actor").exists()


def test_candidate_refuses_an_acceptance_other_than_the_expected_one(run_copy, tmp_path):
    m = matrix_with(tmp_path, engines=["torch-tp"])
    with pytest.raises(EvidenceError, match="has digest sha256:[0-9a-f]+, not the expected sha256:pinned"):
        run_candidates(m, run_copy, only="torch-tp-fp32-tp1-actor", expect="sha256:pinned")
    assert not RunLayout(run_copy).case("torch-tp-fp32-tp1-actor").exists()


def test_a_freeze_killed_midway_leaves_no_temp_file_once_it_runs_again(run_copy):
    """A freeze killed while it wrote (a scheduler's SIGKILL) leaves its temp files in acceptance/ and its work
    directory; the next freeze removes them and writes the same acceptance, byte for byte."""
    from tests.integration._support import killed_writer

    layout = RunLayout(run_copy)
    frozen = layout.acceptance.read_bytes()
    shutil.rmtree(layout.acceptance_dir)
    for target in (layout.acceptance, layout.bounds / "actor-fp32-repeat.json",
                   layout.freeze_work / "actor-fp32-repeat.json"):
        killed_writer(target)
    assert len(list(run_copy.rglob("*.tmp"))) == 3
    freeze(run_copy)
    assert list(run_copy.rglob("*.tmp")) == [] and layout.acceptance.read_bytes() == frozen
