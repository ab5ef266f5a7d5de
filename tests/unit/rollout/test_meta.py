"""qualify.rollout.meta: a sealed rollout's rollout.json read back typed and given back key for key (the reference's
capture with routes and layer outputs, a round's, an older one without the later keys); a read field of another type
refused naming it."""

from __future__ import annotations

import json

import pytest

from qualify.errors import EvidenceError
from qualify.rollout.meta import RolloutMeta, read_rollout_meta
from qualify.store import dumps_json, read_json, write_json

CAPTURED = {"vllm_tp": 1, "sampling": {"temperature": 0.8, "top_k": -1, "top_p": 1.0, "min_p": 0.0,
                                       "max_new_tokens": 8, "eos_token_id": 2, "seed": 0, "seeds": [0, 1],
                                       "dtype": "bfloat16"},
            "logprobs_mode": "processed_logprobs", "finish_reasons": ["length", "stop"], "block_size": 16,
            "model_runner": "v1", "timings_s": {"load": 1.5, "generate": 0.25}, "model_dir": "/m",
            "model_digest": "sha256:" + "0" * 64, "env": {"VLLM_BATCH_INVARIANT": "1"}, "shm_removed": [],
            "versions": {"vllm": "0.11"}, "platform": {"gpu": "H100"},
            "prefill_vs_decode": {"num_tokens": 9, "num_not_bitwise": 0},
            "batch_invariant": {"CUBLAS_WORKSPACE_CONFIG": ":16:8"},
            "routes": {"source": "vllm", "moe_layers": [0, 1], "meaning": "routes_BTLK[b, t, l, k]"},
            "layer_outputs": {"file": "layers.safetensors", "source": "vllm", "names": ["model.layers.0"],
                              "rows": [0, 1], "dtype": "bfloat16", "seconds": 0.5, "meaning": "name[b, t]"},
            "extra_digests": {"layers.safetensors": "sha256:" + "1" * 64}, "digest": "sha256:" + "2" * 64}
"""The keys the reference's capture writes for a MoE rollout with layer outputs in batch-invariant mode."""
ROUND = {"version": 3, "vllm_tp": 2, "sampling": {"temperature": 1.0, "dtype": "float32"}, "block_size": 32,
         "model_runner": None, "logprobs_mode": "processed_logprobs", "finish_reasons": ["stop"],
         "digest": "sha256:" + "3" * 64}
"""What a round's rollout.json holds (qualify.rounds)."""


@pytest.mark.parametrize("doc", [CAPTURED, ROUND, {"vllm_tp": 1, "sampling": {"dtype": "float32"}}])
def test_a_written_rollout_json_reads_back_and_is_given_back_key_for_key(tmp_path, doc):
    write_json(tmp_path / "rollout.json", doc)
    meta, written = read_rollout_meta(tmp_path), read_json(tmp_path / "rollout.json")
    assert meta.to_json() == written == doc and list(meta.to_json()) == list(written)
    assert dumps_json(meta.to_json()).encode("ascii") == (tmp_path / "rollout.json").read_bytes()
    assert RolloutMeta.from_json(meta.to_json()) == meta
    assert meta.dtype == doc["sampling"]["dtype"] and meta.block_size == doc.get("block_size")


def test_the_read_fields_are_typed():
    meta = RolloutMeta.from_json(json.loads(json.dumps(CAPTURED)))
    assert (meta.dtype, meta.block_size, meta.model_runner, meta.batch_invariant) == ("bfloat16", 16, "v1", True)
    assert (meta.routes_source, meta.moe_layers) == ("vllm", [0, 1])
    assert (meta.layer_names, meta.layer_rows) == (["model.layers.0"], [0, 1])
    assert meta.platform == {"gpu": "H100"} and meta.prefill_vs_decode == {"num_tokens": 9, "num_not_bitwise": 0}
    dense = RolloutMeta.from_json(ROUND)
    assert (dense.routes_source, dense.moe_layers, dense.layer_names, dense.layer_rows) == (None, None, None, None)
    assert (dense.model_runner, dense.batch_invariant, dense.platform, dense.prefill_vs_decode) == (None, False, None,
                                                                                                  None)
    # batch-invariant mode is read from the mode's settings or from vLLM's env
    assert RolloutMeta.from_json({"env": {"VLLM_BATCH_INVARIANT": "1"}}).batch_invariant
    assert RolloutMeta.from_json({"batch_invariant": {"X": "1"}, "env": {}}).batch_invariant
    assert not RolloutMeta.from_json({"batch_invariant": None, "env": {"VLLM_BATCH_INVARIANT": "0"}}).batch_invariant


@pytest.mark.parametrize(("change", "named"), [
    ({"sampling": {"dtype": 16}}, "sampling.dtype"), ({"sampling": "bf16"}, "sampling"),
    ({"block_size": "16"}, "block_size"), ({"block_size": True}, "block_size"), ({"model_runner": 2}, "model_runner"),
    ({"platform": "H100"}, "platform"), ({"prefill_vs_decode": []}, "prefill_vs_decode"),
    ({"routes": {"source": "vllm", "moe_layers": 2}}, "routes.moe_layers"), ({"routes": []}, "routes"),
    ({"layer_outputs": {"names": "a", "rows": [0]}}, "layer_outputs.names"), ({"env": ["X"]}, "env")])
def test_a_field_of_another_type_is_refused_naming_it(change, named):
    with pytest.raises(EvidenceError, match=named):
        RolloutMeta.from_json(CAPTURED | change, "rollout/tp1/rollout.json")


def test_a_document_that_is_not_an_object_or_not_there_is_refused(tmp_path):
    with pytest.raises(EvidenceError, match="not a JSON object"):
        RolloutMeta.from_json([CAPTURED])
    with pytest.raises(EvidenceError, match="missing file"):
        read_rollout_meta(tmp_path)
