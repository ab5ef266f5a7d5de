"""Real vLLM capture on this machine: same platform and seeds give the same rollout, even side by side.

Two TP1 captures run at the same time (as two jobs on one node would): both must finish, neither may
be blamed for the other's shared-memory segments, and their rollouts must be bitwise identical.
Nothing here compares with a rollout made on another machine (a rollout is platform-specific).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from qualify.layout import RunLayout
from qualify.models.tiny import make_tiny_family
from qualify.reference.evidence import model_config
from qualify.rollout.capture import ROLLOUT_FILE, capture_rollout, load_rollout
from qualify.rollout.shm import SHM
from qualify.stages import stage_is_complete

pytestmark = pytest.mark.vllm


def test_two_concurrent_captures_are_bitwise_identical(tiny_matrix, tmp_path):
    layout = RunLayout(tmp_path / "run")
    models = make_tiny_family(tiny_matrix.models.tiny, layout.models)
    cfg = model_config(models["actor"])
    before = {p.name for p in SHM.glob("*")} if SHM.is_dir() else set()
    outs = [tmp_path / "a" / "tp1", tmp_path / "b" / "tp1"]
    with ThreadPoolExecutor(2) as pool:
        digests = list(pool.map(lambda out: capture_rollout(
            tiny_matrix.capture, models["actor"], 1, out, vocab_size=cfg["vocab_size"],
            eos_token_id=cfg.get("eos_token_id")), outs))
    assert all(stage_is_complete(out) for out in outs)
    assert digests[0] == digests[1]
    assert (outs[0] / ROLLOUT_FILE).read_bytes() == (outs[1] / ROLLOUT_FILE).read_bytes()
    for out in outs:
        meta = json.loads((out / "rollout.json").read_text())
        assert meta["platform"]["cpu_model"] and meta["platform"]["torch_threads"] >= 1
        assert meta["model_digest"].startswith("sha256:")
        assert meta["block_size"] == tiny_matrix.rollout.block_size  # what an engine replaying vLLM's attention reads
        assert meta["model_runner"] in ("v1", "v2")  # vLLM's runner, whose logprob kernel an exact engine replays
        assert not set(meta["shm_removed"]) & before  # only segments the capture's own processes used
    rollout = load_rollout(outs[0], digests[0])
    assert rollout["response_mask_BT"].any() and torch.isfinite(rollout["sampler_logprobs_BT"]).all()


def test_tp2_capture_samples_the_same_prompts(tiny_matrix, frozen_run, tmp_path):
    layout = RunLayout(tmp_path / "run")
    models = make_tiny_family(tiny_matrix.models.tiny, layout.models)
    cfg = model_config(models["actor"])
    digest = capture_rollout(tiny_matrix.capture, models["actor"], 2, layout.rollout(2), vocab_size=cfg["vocab_size"],
                             eos_token_id=cfg.get("eos_token_id"))
    tp2 = load_rollout(layout.rollout(2), digest)
    committed = load_rollout(RunLayout(frozen_run).rollout(1))
    def prompts(r):
        return [ids[mask].tolist() for ids, mask in zip(r["input_ids_BT"], r["prompt_mask_BT"], strict=True)]

    assert prompts(tp2) == prompts(committed)
    assert tp2["response_mask_BT"].any(dim=1).all()
    assert torch.isfinite(tp2["sampler_logprobs_BT"]).all()


def test_a_failing_vllm_child_is_one_line_with_its_log(tiny_matrix, tmp_path):
    from qualify.errors import QualifyError
    from qualify.rollout.capture import capture_request, run_vllm

    layout = RunLayout(tmp_path / "run")
    models = make_tiny_family(tiny_matrix.models.tiny, layout.models)
    cfg = model_config(models["actor"])
    request = capture_request(tiny_matrix.capture, models["actor"], 1, vocab_size=cfg["vocab_size"],
                              eos_token_id=cfg.get("eos_token_id")) | {"max_model_len": 4}  # prompts are 16 tokens
    with pytest.raises(QualifyError) as info:
        run_vllm(request)
    message = str(info.value)
    assert "\n" not in message and "vLLM capture at TP1 failed" in message and "full log: " in message
    log = message.rsplit("full log: ", 1)[1].rstrip(")")
    assert len(Path(log).read_text().splitlines()) > 1
