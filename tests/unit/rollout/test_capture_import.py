"""Reusing a sealed rollout (`qualify reference --rollout`): only for the same settings, only untampered."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qualify.errors import EvidenceError
from qualify.hashing import sha256_file
from qualify.rollout.capture import ROLLOUT_FILE, import_rollout, load_rollout, model_digest
from qualify.stages import complete_stage, prepare_stage, stage_is_complete
from qualify.store import write_json, write_tensors

SETTINGS = "sha256:" + "ab" * 32


def sealed_rollout(path: Path, settings: str = SETTINGS) -> str:
    prepare_stage(path)
    write_tensors(path / ROLLOUT_FILE, {"input_ids_BT": torch.arange(12).reshape(2, 6),
                                        "sampler_logprobs_BT": torch.linspace(-3, 0, 12).reshape(2, 6)})
    digest = "sha256:" + sha256_file(path / ROLLOUT_FILE)[1]
    write_json(path / "rollout.json", {"digest": digest})
    complete_stage(path, {"digest": digest, "settings": settings})
    return digest


def test_import_copies_a_matching_sealed_rollout(tmp_path):
    digest = sealed_rollout(tmp_path / "src")
    assert import_rollout(tmp_path / "src", tmp_path / "dst", SETTINGS, 1) == digest
    assert stage_is_complete(tmp_path / "dst")
    assert (tmp_path / "dst" / ROLLOUT_FILE).read_bytes() == (tmp_path / "src" / ROLLOUT_FILE).read_bytes()
    assert torch.equal(load_rollout(tmp_path / "dst", digest)["input_ids_BT"], torch.arange(12).reshape(2, 6))


def test_import_refuses_other_settings(tmp_path):
    sealed_rollout(tmp_path / "src", settings="sha256:" + "cd" * 32)
    with pytest.raises(EvidenceError, match="other settings or weights"):
        import_rollout(tmp_path / "src", tmp_path / "dst", SETTINGS, 1)
    assert not (tmp_path / "dst").exists()


def test_import_refuses_a_tampered_rollout(tmp_path):
    sealed_rollout(tmp_path / "src")
    data = bytearray((tmp_path / "src" / ROLLOUT_FILE).read_bytes())
    data[-1] ^= 1
    (tmp_path / "src" / ROLLOUT_FILE).write_bytes(bytes(data))
    with pytest.raises(EvidenceError, match="missing, partial or modified"):
        import_rollout(tmp_path / "src", tmp_path / "dst", SETTINGS, 1)


def test_import_refuses_a_seal_whose_digest_lies(tmp_path):
    sealed_rollout(tmp_path / "src")
    complete_stage(tmp_path / "src", {"digest": "sha256:" + "00" * 32, "settings": SETTINGS})  # resealed by hand
    with pytest.raises(EvidenceError, match="its seal says"):
        import_rollout(tmp_path / "src", tmp_path / "dst", SETTINGS, 1)


def test_load_rollout_refuses_another_digest(tmp_path):
    sealed_rollout(tmp_path / "src")
    with pytest.raises(EvidenceError, match="refusing to run on a different rollout"):
        load_rollout(tmp_path / "src", "sha256:" + "11" * 32)


def test_model_digest_follows_weights_not_path_or_seal(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "model.safetensors").write_bytes(b"weights")
    complete_stage(tmp_path / "b")
    assert model_digest(tmp_path / "a") == model_digest(tmp_path / "b")
    (tmp_path / "b" / "model.safetensors").write_bytes(b"weightz")
    assert model_digest(tmp_path / "a") != model_digest(tmp_path / "b")


def test_model_digest_ignores_which_transformers_wrote_the_config(tmp_path):
    for name, version in (("a", "5.19.0"), ("b", "5.17.0")):
        (tmp_path / name).mkdir()
        write_json(tmp_path / name / "config.json", {"vocab_size": 512, "transformers_version": version})
        (tmp_path / name / "model.safetensors").write_bytes(b"weights")
    assert model_digest(tmp_path / "a") == model_digest(tmp_path / "b")
    write_json(tmp_path / "b" / "config.json", {"vocab_size": 513, "transformers_version": "5.17.0"})
    assert model_digest(tmp_path / "a") != model_digest(tmp_path / "b")


def test_reusing_the_committed_rollout_then_finding_it_complete_is_logged_as_skipped(tmp_path, capsys):
    from qualify.layout import RunLayout
    from qualify.matrix import load_matrix
    from qualify.models.tiny import make_tiny_family
    from qualify.reference.stage import capture_all
    from qualify.stagelog import StageLog
    from tests.conftest import COMMITTED, TINY

    matrix = load_matrix(TINY)
    layout = RunLayout(tmp_path / "run")
    models = make_tiny_family(matrix.models.tiny, layout.models)
    first = capture_all(matrix.capture, layout, models, StageLog("reference"), COMMITTED / "reference" / "rollout")
    assert "reference/rollout/tp1: done in" in capsys.readouterr().err
    again = capture_all(matrix.capture, layout, models, StageLog("reference"), COMMITTED / "reference" / "rollout")
    err = capsys.readouterr().err
    assert first == again and "complete, skipped" in err and "done in" not in err
