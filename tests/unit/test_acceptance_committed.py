"""Every committed acceptance (manifests/*/acceptance/acceptance.json) is sound: schema, bound digests, rule;
and the evidence committed beside it (rollout, targets, r0 scores) is the evidence it names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qualify.acceptance import check_acceptance
from qualify.errors import ManifestError
from qualify.manifest import load_manifest, verify_manifest
from qualify.store import read_json

REPO = Path(__file__).resolve().parents[2]
COMMITTED = sorted((REPO / "manifests").glob("*/acceptance/acceptance.json"))


def test_there_is_a_committed_acceptance():
    assert any(p.parent.parent.name == "tiny-qwen3" for p in COMMITTED)


@pytest.mark.parametrize("path", COMMITTED, ids=[p.parent.parent.name for p in COMMITTED])
def test_committed_acceptance_is_sound(path):
    assert check_acceptance(path) == []


def _copy(tmp_path: Path) -> Path:
    src = REPO / "manifests" / "tiny-qwen3"
    dst = tmp_path / "acc"
    shutil.copytree(src, dst)
    return dst / "acceptance" / "acceptance.json"


def test_edited_bound_file_is_caught(tmp_path):
    acc = _copy(tmp_path)
    bound = acc.parent / "bounds" / "actor-fp32-repeat.json"
    bound.write_text(bound.read_text().replace('"k": 4.0', '"k": 4.5'))
    assert any("does not match" in p for p in check_acceptance(acc))


def test_bound_that_breaks_the_rule_is_caught(tmp_path):
    from qualify.bounds.check import check_bounds

    doc = json.loads((REPO / "manifests/tiny-qwen3/acceptance/bounds/critic-bf16-repeat.json").read_text())
    rule = json.loads((REPO / "manifests/tiny-qwen3/acceptance/acceptance.json").read_text())["rule"]
    key = min(doc["bounds"])
    metric = min(doc["bounds"][key])
    doc["bounds"][key][metric]["bound"] *= 2
    assert any(key in p for p in check_bounds(doc, rule, "x.json"))


def test_hand_edited_acceptance_is_refused(tmp_path):
    acc = _copy(tmp_path)
    acc.write_text(acc.read_text().replace('"k": 4.0', '"k": 8.0', 1))
    with pytest.raises(ManifestError, match="digest"):
        check_acceptance(acc)


@pytest.mark.parametrize("path", COMMITTED, ids=[p.parent.parent.name for p in COMMITTED])
def test_committed_evidence_is_what_the_acceptance_names(path):
    report = verify_manifest(path, partial=True, progress=False)
    assert report.ok, report.to_json()
    present = {e["path"] for e in load_manifest(path)["files"]} - set(report.missing)
    doc = load_manifest(path)
    assert {"rollout/tp1/rollout.safetensors", "targets/targets.safetensors", "matrix/matrix.json",
            "scores/fp32-r0/actor/step0/grads.safetensors", "scores/bf16-r0/critic/step3/moments.safetensors"} <= present
    assert doc["platform"]["cpu_model"] and doc["platform"]["torch_cpu_capability"]
    assert read_json(path.parent.parent / "reference" / "rollout" / "tp1" / "rollout.json")["digest"] == \
        doc["rollout_digest"]


def test_tampered_committed_rollout_fails_partial_verify(tmp_path):
    acc = _copy(tmp_path)
    rollout = acc.parent.parent / "reference" / "rollout" / "tp2" / "rollout.safetensors"
    data = bytearray(rollout.read_bytes())
    data[-1] ^= 1
    rollout.write_bytes(bytes(data))
    report = verify_manifest(acc, partial=True, progress=False)
    assert not report.ok and [m.path for m in report.modified] == ["rollout/tp2/rollout.safetensors"]


def test_extra_file_in_committed_evidence_fails_partial_verify(tmp_path):
    acc = _copy(tmp_path)
    (acc.parent.parent / "reference" / "rollout" / "tp1" / "notes.txt").write_text("x")
    report = verify_manifest(acc, partial=True, progress=False)
    assert not report.ok and report.extra == ["rollout/tp1/notes.txt"]


def test_an_edited_layer_bound_file_is_named(tmp_path):
    """The committed acceptance names its layer bound files (qualify diagnose) by digest; an edited one is a problem."""
    copy = tmp_path / "acceptance"
    shutil.copytree(REPO / "manifests" / "tiny-qwen3" / "acceptance", copy)
    layer_files = sorted((copy / "layers").glob("*.json"))
    assert layer_files and check_acceptance(copy / "acceptance.json") == []
    layer_files[0].write_text(layer_files[0].read_text().replace("1", "2", 1))
    assert check_acceptance(copy / "acceptance.json") == [
        f"layer bound file {layer_files[0]} does not match the acceptance's digest"]
    layer_files[0].unlink()
    assert check_acceptance(copy / "acceptance.json") == [f"missing layer bound file {layer_files[0]}"]
