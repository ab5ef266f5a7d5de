"""`qualify verify` of an acceptance follows its chain of digests, not only its file list: the bound files it names
(by digest, every bound re-derived from the rule), the rule against the sealed matrix snapshot it covers, the part a
partial copy must hold, and an expected digest pinned outside the run. Each attack here passed `verify` before."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qualify.acceptance import Acceptance, committed_part, verify_evidence
from qualify.cli.app import app
from qualify.errors import EvidenceError
from qualify.manifest import digest_of

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "manifests" / "tiny-qwen3"
PINNED = "sha256:000fb45639d4d8d3d1289431d543a3ee2aed2834176ad2f3aad5ec62ed5425e4"
"""The committed acceptance's own digest, pinned here (under review, outside the run): re-freezing it changes this."""


def verify(*args: str):
    return CliRunner().invoke(app, ["verify", *args])


@pytest.fixture
def copy(tmp_path) -> Path:
    shutil.copytree(COMMITTED, tmp_path / "tiny-qwen3")
    return tmp_path / "tiny-qwen3" / "acceptance" / "acceptance.json"


def rewrite(path: Path, doc: dict) -> None:
    doc["digest"] = digest_of(doc)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True))


def test_the_committed_acceptance_verifies_with_its_pinned_digest():
    result = verify(str(COMMITTED / "acceptance" / "acceptance.json"), "--partial", "--expect", PINNED)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("OK 90 of 300 files match")


def test_another_expected_digest_fails_whatever_the_files_say():
    result = verify(str(COMMITTED / "acceptance" / "acceptance.json"), "--partial", "--expect", "sha256:" + "0" * 64)
    assert result.exit_code == 1 and f"digest {PINNED} is not the expected sha256:{'0' * 64}" in result.output


def test_a_partial_copy_must_hold_its_committed_part(copy, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = verify(str(copy), "--partial", "--evidence", str(empty))
    assert result.exit_code == 1
    assert "the committed part of the acceptance is not all here: 90 of its files are missing" in result.output
    (copy.parents[1] / "reference" / "scores" / "fp32-r0" / "actor" / "step2" / "grads.safetensors").unlink()
    result = verify(str(copy), "--partial")
    assert result.exit_code == 1 and "1 of its files are missing (scores/fp32-r0/actor/step2/grads.safetensors)" in \
        result.output
    assert committed_part("scores/bf16-r0/critic/meta.json") and committed_part("matrix/matrix.json")
    assert not committed_part("scores/bf16-r1/critic/meta.json") and not committed_part("models/actor/config.json")


def test_partial_is_refused_for_a_plain_manifest(tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "a.bin").write_bytes(b"a")
    assert CliRunner().invoke(app, ["manifest", "create", str(tmp_path / "e"), "--out", str(tmp_path / "m.json")]) \
        .exit_code == 0
    result = verify(str(tmp_path / "m.json"), "--partial")
    assert result.exit_code == 2 and "--partial is for an acceptance" in result.output


def test_a_widened_or_missing_bound_file_fails_verify(copy):
    bound = copy.parent / "bounds" / "actor-fp32-repeat.json"
    doc = json.loads(bound.read_text())
    entry = doc["bounds"]["step1/grads/lm_head.weight"]["max_abs"]
    entry["bound"] *= 100
    bound.write_text(json.dumps(doc))
    result = verify(str(copy), "--partial")
    assert result.exit_code == 1 and "bound file" in result.output and "does not match the acceptance's digest" in \
        result.output
    bound.unlink()
    result = verify(str(copy), "--partial")
    assert result.exit_code == 1 and "missing bound file" in result.output


def test_a_rule_rewritten_with_every_digest_recomputed_fails_against_the_matrix_snapshot(copy):
    doc = json.loads(copy.read_text())
    doc["rule"]["k"] = 1e7
    for name in doc["bounds"]:
        file = copy.parent / "bounds" / name
        b = json.loads(file.read_text())
        b["k"] = 1e7
        for metrics in b["bounds"].values():
            for e in metrics.values():
                e["bound"] = 1e7 * e["control_error"] + e["floor"] + e["quantum"]
        file.write_text(json.dumps(b))
        doc["bounds"][name] = "sha256:" + hashlib.sha256(file.read_bytes()).hexdigest()
    rewrite(copy, doc)
    report = verify_evidence(copy, partial=True, progress=False)
    assert not report.ok
    assert report.problems == ["the acceptance's rule says k = 10000000.0, the matrix snapshot it covers says 4.0"]
    with pytest.raises(EvidenceError, match="does not follow from what it was frozen from: the acceptance's rule says "
                                            "k = 10000000.0"):
        Acceptance.load(copy, partial=True)
    assert verify(str(copy), "--partial", "--expect", PINNED).exit_code == 1  # and the anchor moved


def test_a_snapshot_sealed_under_another_digest_than_the_acceptance_names_fails(copy):
    doc = json.loads(copy.read_text())
    doc["matrix_digest"] = "sha256:" + "1" * 64
    rewrite(copy, doc)
    report = verify_evidence(copy, partial=True, progress=False)
    assert len(report.problems) == 1 and "the acceptance names 'sha256:1111" in report.problems[0]


def test_the_evidence_hint_cannot_send_verify_to_another_copy(copy, tmp_path):
    """The reference of the run is tampered with, an untouched copy lies beside it, and the acceptance's evidence
    hint (with its digest recomputed) names the copy: verify refuses the hint, and checks the run's own reference."""
    untouched = tmp_path / "untouched"
    shutil.copytree(copy.parents[1] / "reference", untouched)
    (copy.parents[1] / "reference" / "reference.json").write_text("{}")
    doc = json.loads(copy.read_text())
    doc["evidence"] = "../../untouched"
    rewrite(copy, doc)
    result = verify(str(copy), "--partial")
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "an acceptance's evidence is the reference/ of its own run" in result.output
    assert "'../../untouched'" in result.output and "--evidence" in result.output
    explicit = verify(str(copy), "--partial", "--evidence", str(copy.parents[1] / "reference"))
    assert explicit.exit_code == 1 and "reference.json" in explicit.output
