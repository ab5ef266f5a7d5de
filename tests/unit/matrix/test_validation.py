"""Matrix validation rules: every bad value is a one-line MatrixError naming the file, the key and
what is allowed, raised at load time (before any capture or engine starts); the shipped matrices still load."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from qualify.errors import MatrixError
from qualify.matrix import load_matrix
from tests.unit.matrix.test_loader import SHIPPED, TINY, deleter, edited, load_error, setter, write


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_matrices_pass_every_rule(path):
    assert load_matrix(path).cases()


# (dotted key, bad value, words the message must hold: the key and what is allowed)
RULES = [
    ("models.tiny.num_kv_heads", 0, "num_kv_heads must be >= 1, got 0"),
    ("models.tiny.num_heads", 0, "num_heads must be >= 1, got 0"),
    ("models.tiny.hidden_size", 0, "hidden_size must be >= 1, got 0"),
    ("models.tiny.intermediate_size", -4, "intermediate_size must be >= 1, got -4"),
    ("models.tiny.num_layers", 0, "num_layers must be >= 1, got 0"),
    ("models.tiny.max_position_embeddings", 0, "max_position_embeddings must be >= 1"),
    ("models.tiny.initializer_range", 0.0, "initializer_range must be > 0"),
    ("models.tiny.initializer_range", math.inf, "initializer_range must be a finite number, got inf"),
    ("models.tiny.rope_theta", -1.0, "rope_theta must be > 0"),
    ("models.tiny.seed", -1, "seed must be in [0, 2^63 - 1], got -1"),
    ("rollout.vllm_tp", [0], "vllm_tp must list degrees >= 1, got [0]"),
    ("rollout.vllm_tp", [1, 1], "vllm_tp lists [1] more than once"),
    ("rollout.vllm_tp", [3], "rollout.vllm_tp 3 does not divide models.tiny.num_heads 4"),
    ("rollout.num_prompts", 0, "num_prompts must be >= 1, got 0"),
    ("rollout.num_prompts", -3, "num_prompts must be >= 1, got -3"),
    ("rollout.prompt_len", 0, "prompt_len must be >= 1, got 0"),
    ("rollout.max_new_tokens", 0, "max_new_tokens must be >= 1, got 0"),
    ("rollout.max_new_tokens", -1, "max_new_tokens must be >= 1, got -1"),
    ("rollout.max_model_len", 1024, "rollout.max_model_len 1024 exceeds models.tiny.max_position_embeddings 512"),
    ("rollout.kv_cache_memory_bytes", 0, "kv_cache_memory_bytes must be >= 1"),
    ("rollout.block_size", 0, "block_size must be >= 1"),
    ("rollout.temperature", math.nan, "temperature must be a finite number, got nan"),
    ("rollout.temperature", math.inf, "temperature must be a finite number, got inf"),
    ("rollout.temperature", -0.5, "temperature must be > 0"),
    ("rollout.top_k", 0, "top_k must be -1 (off) or >= 1, got 0"),
    ("rollout.top_k", -2, "top_k must be -1 (off) or >= 1, got -2"),
    ("rollout.top_p", math.nan, "top_p must be a finite number"),
    ("rollout.seed", -5, "seed must be in [0, 2^63 - 1], got -5"),
    ("rollout.seed", 2**63 - 2, "seed + num_prompts - 1 must be <= 2^63 - 1"),
    ("rollout.eos_token_id", 512, "rollout.eos_token_id 512 is not in the vocabulary (must be < models.tiny"),
    ("rollout.eos_token_id", -1, "eos_token_id must be >= 0"),
    ("rollout.prompts_file", "", "prompts_file must be a path or null"),
    ("ppo.clip_eps", 0.0, "clip_eps must be > 0"),
    ("ppo.value_clip_eps", -0.2, "value_clip_eps must be > 0"),
    ("ppo.gamma", 1.5, "gamma must be in [0, 1], got 1.5"),
    ("ppo.lam", -0.1, "lam must be in [0, 1]"),
    ("ppo.kl_coef", -0.05, "kl_coef must be >= 0"),
    ("ppo.clip_eps_low", 1.0, "clip_eps_low must be in (0, 1)"),
    ("ppo.clip_eps_low", 0.0, "clip_eps_low must be in (0, 1)"),
    ("ppo.clip_eps_high", 0.0, "clip_eps_high must be > 0, got 0.0"),
    ("ppo.clip_eps_high", math.inf, "clip_eps_high must be a finite number, got inf"),
    ("ppo.dual_clip_c", 1.0, "dual_clip_c must be > 1"),
    ("ppo.dual_clip_c", 0.5, "dual_clip_c must be > 1"),
    ("ppo.entropy_coef", -0.01, "entropy_coef must be >= 0, got -0.01"),
    ("freeze.require", ["policy_clip_dual"], ("freeze.require lists policy_clip_dual, which no reference of this "
                                              "matrix can exercise: set ppo.dual_clip_c")),
    ("ppo.kl_coef", math.nan, "kl_coef must be a finite number"),
    ("optimizer.lr", 0.0, "lr must be > 0, got 0.0"),
    ("optimizer.lr", -1.0e-3, "lr must be > 0"),
    ("optimizer.lr", math.inf, "lr must be a finite number"),
    ("optimizer.betas", [0.9, 1.0], "betas[1] must be in [0, 1), got 1.0"),
    ("optimizer.betas", [-0.1, 0.999], "betas[0] must be in [0, 1), got -0.1"),
    ("optimizer.betas", [math.nan, 0.999], "betas[0] must be a finite number, got nan"),
    ("optimizer.eps", 0.0, "eps must be > 0"),
    ("optimizer.weight_decay", -0.01, "weight_decay must be >= 0"),
    ("optimizer.max_grad_norm", -1.0, "max_grad_norm must be >= 0, got -1.0"),
    ("reference.precisions", ["fp32", "bf16", "bf16"], "precisions lists ['bf16'] more than once"),
    ("reference.perturbations", ["attn_impl", "attn_impl"], "perturbations lists ['attn_impl'] more than once"),
    ("freeze.k", math.inf, "k must be a finite number, got inf"),
    ("freeze.k", math.nan, "k must be a finite number, got nan"),
    ("freeze.k", -4.0, "k must be >= 1"),
    ("freeze.floors.grad", -1.0e-6, "floors must be >= 0: grad -1e-06"),
    ("freeze.floors.logprob", math.inf, "floors.logprob must be a finite number, got inf"),
    ("freeze.floors.value", math.nan, "floors.value must be a finite number, got nan"),
    ("candidates.engines", [], "engines must list at least one value"),
    ("candidates.engines", ["torch-tp", "torch-tp"], "engines lists ['torch-tp'] more than once"),
    ("candidates.engines", ["torchtp"], "unknown engine 'torchtp' (known: deepspeed, deepspeed-zero1, deepspeed-zero2, deepspeed-zero3, "),
    ("candidates.engines", ["../evil:f"], "unknown engine '../evil:f'"),
    ("candidates.tp", [3], "candidates.tp 3 does not divide models.tiny.num_heads 4"),
    ("candidates.tp", [0], "tp must list degrees >= 1, got [0]"),
    ("candidates.tp", [-2], "tp must list degrees >= 1, got [-2]"),
    ("candidates.tp", [1, 2, 1], "tp lists [1] more than once"),
    ("candidates.tp", [], "tp must list at least one value"),
    ("candidates.precisions", [], "precisions must list at least one value"),
    ("candidates.roles", ["actor", "actor"], "roles lists ['actor'] more than once"),
    ("candidates.topologies", [], "topologies must list at least one value"),
    ("rounds.engine", "torchtp", "engine: unknown engine 'torchtp' (known: deepspeed, deepspeed-zero1, deepspeed-zero2, deepspeed-zero3, "),
    ("rounds.rounds", 1, "rounds must be >= 2 (an install needs a round after it), got 1"),
    ("rounds.train_tp", 0, "vllm_tp and train_tp must be >= 1"),
    ("rounds.vllm_tp", 0, "vllm_tp and train_tp must be >= 1"),
    ("rounds.probes", ["stale", "stale"], "probes lists ['stale'] more than once"),
    ("rounds.probes", ["stale", "nosuch"], "probes: unknown ['nosuch'] (known: stale, wrong-shard"),
    ("name", "../../escape", "name '../../escape' must be 1-100 ASCII letters"),
    ("name", "caf\u00e9", "name 'caf\u00e9' must be 1-100 ASCII"),
    ("name", "", "name '' must be 1-100"),
    ("name", "a" * 101, "must be 1-100 ASCII"),
    ("name", "two\nlines", "name 'two\\nlines' must be"),
    ("description", "one\nsecond line", "description must be one line"),
]


@pytest.mark.parametrize("dotted, value, expected", RULES, ids=[f"{d}={v!r}" for d, v, _ in RULES])
def test_rule(tmp_path, dotted, value, expected):
    message = load_error(tmp_path, edited(setter(dotted, value)))
    assert expected in message, message
    assert len(message) < 400


def test_tp_must_divide_the_kv_heads(tmp_path):
    data = edited(setter("models.tiny.num_heads", 8))  # 8 query heads over 2 KV heads: TP4 divides only the first
    data["candidates"]["tp"] = [4]
    assert "candidates.tp 4 does not divide models.tiny.num_kv_heads 2" in load_error(tmp_path, data)


def test_tp_must_divide_the_mlp(tmp_path):
    data = edited(setter("models.tiny.intermediate_size", 129))
    assert "candidates.tp 2 does not divide models.tiny.intermediate_size 129" in load_error(tmp_path, data)


@pytest.mark.parametrize("dotted, value", [
    ("rollout.top_k", 5), ("rollout.top_k", -1), ("rollout.eos_token_id", 511), ("rollout.eos_token_id", 0),
    ("optimizer.max_grad_norm", 0.0), ("optimizer.betas", [0.0, 0.0]), ("freeze.floors.grad", 0.0),
    ("ppo.gamma", 0.0), ("ppo.kl_coef", 0.0), ("candidates.engines", ["my_pkg.engines:factory"]),
    ("candidates.tp", [2, 1]), ("name", "qwen3_8b.v2-run"), ("rollout.vllm_tp", [2]),
])
def test_boundary_values_still_load(tmp_path, dotted, value):
    data = edited(setter(dotted, value))
    if dotted == "optimizer.max_grad_norm":  # clipping off: a grad_clip requirement could never be met (refused)
        data["freeze"]["require"] = [b for b in data["freeze"]["require"] if b != "grad_clip"]
    load_matrix(write(tmp_path, data))


def test_normalizer_constant_must_be_positive(tmp_path):
    data = edited(setter("ppo.token_normalizer", "constant"))
    data["ppo"]["normalizer_constant"] = 0.0
    assert "normalizer_constant must be > 0" in load_error(tmp_path, data)
    data["ppo"]["normalizer_constant"] = 64.0
    assert load_matrix(write(tmp_path, data)).ppo.normalizer_constant == 64.0


def checkpoint_matrix(tmp_path: Path, config: dict | str | None, **rollout) -> Path:
    data = edited(deleter("models.tiny"))
    data["models"]["checkpoints"] = {"actor": "actor", "reference": "actor", "critic": "critic", "reward": "reward"}
    data["rollout"] |= rollout
    if config is not None:
        (tmp_path / "actor").mkdir()
        text = config if isinstance(config, str) else json.dumps(config)
        (tmp_path / "actor" / "config.json").write_text(text)
    return write(tmp_path, data)


QWEN3_8B = {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 12288, "vocab_size": 151936}


def test_checkpoint_family_is_checked_against_config_json(tmp_path):
    assert load_matrix(checkpoint_matrix(tmp_path, QWEN3_8B)).models.checkpoints.actor == "actor"
    bad = tmp_path / "bad"
    bad.mkdir()
    path = checkpoint_matrix(bad, QWEN3_8B | {"num_key_value_heads": 1})
    with pytest.raises(MatrixError, match=r"candidates.tp 2 does not divide models.checkpoints.actor config.json"
                                          r".num_kv_heads 1") as info:
        load_matrix(path)
    assert str(info.value).startswith(f"{path}: ")


def test_checkpoint_eos_beyond_the_vocab(tmp_path):
    path = checkpoint_matrix(tmp_path, QWEN3_8B, eos_token_id=151936)
    with pytest.raises(MatrixError, match="eos_token_id 151936 is not in the vocabulary"):
        load_matrix(path)


def test_checkpoint_config_that_is_not_a_model_config(tmp_path):
    with pytest.raises(MatrixError, match="lacks positive integers num_attention_heads"):
        load_matrix(checkpoint_matrix(tmp_path, {"num_attention_heads": 0}))
    deep = tmp_path / "deep"
    deep.mkdir()
    with pytest.raises(MatrixError, match="cannot read .*config.json: RecursionError"):
        load_matrix(checkpoint_matrix(deep, "[" * 100_000 + "]" * 100_000))


def test_checkpoints_not_copied_yet_still_load(tmp_path):
    assert load_matrix(checkpoint_matrix(tmp_path, None)).models.checkpoints is not None


def test_unedited_copy_loads(tmp_path):
    assert load_matrix(write(tmp_path, TINY)).name == "tiny-qwen3"
