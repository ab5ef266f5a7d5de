"""What every vLLM tensor-parallel rank must hold for a Qwen3 causal LM, derived from the HF tensors.

The harness computes these itself, from the HF-named weights of a version and the model config,
so that a rank's report of what it holds is compared with an independent expectation (not with
the file the rank was told to load). vLLM's layout of Qwen3 at TP degree tp, rank r:
  qkv_proj     rows: q heads [r*H/tp, (r+1)*H/tp), then the rank's k and v heads; when tp > KV
               heads, each kv head is replicated on tp/KV consecutive ranks (kv shard r // (tp/KV))
  o_proj       columns of the rank's q heads (row-parallel)
  gate_up_proj rows: gate [r*I/tp, (r+1)*I/tp), then up, same rows (column-parallel, merged)
  down_proj    columns [r*I/tp, (r+1)*I/tp) (row-parallel)
  embed_tokens, lm_head  vocab padded to a multiple of 64 and split in equal row blocks; a rank's
               rows past the real vocabulary are zero; a tied lm_head holds the embedding's rows
  norms (input_layernorm, post_attention_layernorm, q_norm, k_norm, model.norm) replicated.
Qwen3-MoE (Qwen3MoeForCausalLM) is the same but for its MoE layers' MLP (every layer but mlp_only_layers, at
decoder_sparse_step), sharded over TP (no expert parallelism: every rank holds every expert):
  mlp.gate             the router, replicated
  mlp.experts.w13_weight  (experts, 2 I/tp, hidden): per expert gate rows [r*I/tp, (r+1)*I/tp), then up, same rows
  mlp.experts.w2_weight   (experts, hidden, I/tp): per expert the down columns [r*I/tp, (r+1)*I/tp)
  (I the moe_intermediate_size; qualify.rounds.vllm_ext reports vLLM's fused experts under these names).
The happy path checks this function against what vLLM actually holds, rank by rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from qualify.errors import QualifyError
from qualify.rounds.digests import tensor_digest

VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
REPLICATED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
              "self_attn.k_norm.weight")
ATTENTION = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight")
DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise QualifyError(f"vLLM TP{b} cannot shard {what} ({a} is not a multiple of {b})")
    return a // b


def _rows(t: torch.Tensor, index: int, size: int) -> torch.Tensor:
    return t[index * size:(index + 1) * size]


def _vocab_rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """The rank's block of the padded vocabulary: real rows, then zeros."""
    vocab = t.shape[0]
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    per_rank = _divide(padded, tp, f"the padded vocabulary {padded}")
    block = t.new_zeros(per_rank, t.shape[1])
    real = t[rank * per_rank:min((rank + 1) * per_rank, vocab)]
    block[:real.shape[0]] = real
    return block


def moe_layers(config: Mapping[str, Any]) -> list[int]:
    """The layers whose MLP is a mixture of experts (transformers' Qwen3MoeDecoderLayer rule); none for dense Qwen3."""
    if config.get("architectures") != ["Qwen3MoeForCausalLM"]:
        return []
    dense, step = set(config.get("mlp_only_layers") or ()), config.get("decoder_sparse_step", 1)
    return [i for i in range(config["num_hidden_layers"]) if i not in dense and step > 0 and (i + 1) % step == 0]


def _expert_shards(w: Mapping[str, torch.Tensor], config: Mapping[str, Any], rank: int,
                   tp: int) -> tuple[list[str], Iterator[tuple[str, torch.Tensor]]]:
    """(HF names used, (vLLM name, tensor)) of one MoE layer's router and experts on rank `rank` (names relative)."""
    experts = config.get("num_experts", config.get("num_local_experts"))
    width = _divide(config["moe_intermediate_size"], tp, "the experts' MLP width")
    names = ["mlp.gate.weight"] + [f"mlp.experts.{e}.{n}_proj.weight" for e in range(experts)
                                   for n in ("gate", "up", "down")]

    def shards() -> Iterator[tuple[str, torch.Tensor]]:
        yield "mlp.gate.weight", w["mlp.gate.weight"]
        yield "mlp.experts.w13_weight", torch.stack([
            torch.cat([_rows(w[f"mlp.experts.{e}.gate_proj.weight"], rank, width),
                       _rows(w[f"mlp.experts.{e}.up_proj.weight"], rank, width)]) for e in range(experts)])
        yield "mlp.experts.w2_weight", torch.stack([
            _rows(w[f"mlp.experts.{e}.down_proj.weight"].t(), rank, width).t() for e in range(experts)])
    return names, shards()


def rank_shards(hf: Mapping[str, torch.Tensor], config: Mapping[str, Any], rank: int,
                tp: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(vLLM name, tensor) of everything rank `rank` of TP `tp` holds, in the HF tensors' dtype."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    q_rows = _divide(heads, tp, "the attention heads") * head_dim
    if tp >= kv_heads:
        kv_rows, kv_shard = head_dim, rank // _divide(tp, kv_heads, "the replicated kv heads")
    else:
        kv_rows, kv_shard = _divide(kv_heads, tp, "the kv heads") * head_dim, rank
    moe = set(moe_layers(config))
    ffn = None if len(moe) == config["num_hidden_layers"] else _divide(config["intermediate_size"], tp, "the MLP width")
    used = set()
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w = {k.removeprefix(p): v for k, v in hf.items() if k.startswith(p)}
        used.update(p + k for k in ATTENTION + REPLICATED)
        yield p + "self_attn.qkv_proj.weight", torch.cat([_rows(w["self_attn.q_proj.weight"], rank, q_rows),
                                                          _rows(w["self_attn.k_proj.weight"], kv_shard, kv_rows),
                                                          _rows(w["self_attn.v_proj.weight"], kv_shard, kv_rows)])
        yield p + "self_attn.o_proj.weight", _rows(w["self_attn.o_proj.weight"].t(), rank, q_rows).t()
        if i in moe:
            names, shards = _expert_shards(w, config, rank, tp)
            used.update(p + k for k in names)
            yield from ((p + name, t) for name, t in shards)
        else:
            used.update(p + k for k in DENSE_MLP)
            yield p + "mlp.gate_up_proj.weight", torch.cat([_rows(w["mlp.gate_proj.weight"], rank, ffn),
                                                            _rows(w["mlp.up_proj.weight"], rank, ffn)])
            yield p + "mlp.down_proj.weight", _rows(w["mlp.down_proj.weight"].t(), rank, ffn).t()
        for name in REPLICATED:
            yield p + name, w[name]
    yield "model.embed_tokens.weight", _vocab_rows(hf["model.embed_tokens.weight"], rank, tp)
    yield "model.norm.weight", hf["model.norm.weight"]
    used.update(("model.embed_tokens.weight", "model.norm.weight"))
    if config.get("tie_word_embeddings", False):  # the head computes with (its copy of) the embedding
        yield "lm_head.weight", _vocab_rows(hf["model.embed_tokens.weight"], rank, tp)
    else:
        yield "lm_head.weight", _vocab_rows(hf["lm_head.weight"], rank, tp)
    used.add("lm_head.weight")  # a tied checkpoint that still has one: vLLM skips it
    unknown = sorted(set(hf) - used)
    if unknown:
        raise QualifyError(f"HF tensors with no known vLLM Qwen3 layout (not checked, so refused): {unknown[:5]}")


def expected_shard_digests(hf: Mapping[str, torch.Tensor], config: Mapping[str, Any], tp: int,
                           dtype: torch.dtype) -> list[dict[str, str]]:
    """Per rank: vLLM name -> digest of the shard that rank must hold, cast to vLLM's dtype."""
    found = config.get("architectures", ["Qwen3ForCausalLM"])
    if len(found) != 1 or found[0] not in ARCHITECTURES:
        raise QualifyError(f"rounds knows vLLM's layout of {' and '.join(ARCHITECTURES)} only, not {found}")
    return [{name: tensor_digest(t.to(dtype)) for name, t in rank_shards(hf, config, rank, tp)} for rank in range(tp)]
