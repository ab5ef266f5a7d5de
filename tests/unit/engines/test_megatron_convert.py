"""HF Qwen3 <-> Megatron shard conversion: bit-exact round trips, layouts against slow loops, refusals."""

from __future__ import annotations

import io

import pytest
import torch

from qualify.engines.megatron_convert import (
    Qwen3Layout,
    conversion_plan,
    hf_names,
    hf_to_megatron,
    megatron_to_hf,
    padded_rows,
)
from qualify.errors import EngineError

transformers = pytest.importorskip("transformers")


def tiny_hf(role: str, vocab: int, kv_heads: int = 2, tie: bool = False, dtype=torch.float32, bias: bool = True):
    """A tiny random HF Qwen3 (hidden 64, 2 layers, 4 heads, head_dim 32, ffn 128); every tensor random."""
    config = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=kv_heads, head_dim=32, intermediate_size=128,
                                      vocab_size=vocab, tie_word_embeddings=tie, num_labels=1,
                                      token_classification_bias=bias)
    torch.manual_seed(vocab + kv_heads)
    cls = transformers.Qwen3ForCausalLM if role == "actor" else transformers.Qwen3ForTokenClassification
    model = cls(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    sd = {k: v.to(dtype) for k, v in model.state_dict().items()}
    if tie:
        sd.pop("lm_head.weight", None)  # what save_pretrained stores for a tied model
    return config, sd


CASES = [(role, vocab, tp) for role in ("actor", "critic") for vocab in (512, 1000) for tp in (1, 2, 4)]


@pytest.mark.parametrize(("role", "vocab", "tp"), CASES)
def test_round_trip_bit_exact(role, vocab, tp):
    # TP4 with 2 KV heads: Megatron gives each rank a slice of one query group and all-gathers qkv.
    config, sd = tiny_hf(role, vocab)
    layout = Qwen3Layout.from_hf_config(config, role)
    shards = hf_to_megatron(sd, layout, tp)
    assert len(shards) == tp and all(set(s) == set(conversion_plan(layout)) for s in shards)
    back = megatron_to_hf(shards, layout)
    assert list(back) == hf_names(layout) and set(back) == set(sd)
    for name, t in sd.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_bf16_and_tied(tp):
    config, sd = tiny_hf("actor", 1000, tie=True, dtype=torch.bfloat16)
    layout = Qwen3Layout.from_hf_config(config, "actor")
    assert layout.tie_word_embeddings and "output_layer.weight" not in conversion_plan(layout)
    back = megatron_to_hf(hf_to_megatron(sd, layout, tp), layout)
    assert set(back) == set(sd) and all(torch.equal(back[k], v) and back[k].dtype == torch.bfloat16
                                        for k, v in sd.items())


def test_negative_control_rank_order_breaks_round_trip():
    config, sd = tiny_hf("actor", 1000)
    layout = Qwen3Layout.from_hf_config(config, "actor")
    shards = hf_to_megatron(sd, layout, 2)
    back = megatron_to_hf(shards[::-1], layout)
    assert not torch.equal(back["model.layers.0.self_attn.q_proj.weight"], sd["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(back["model.layers.0.mlp.up_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_layout_matches_slow_loop(tp):
    config, sd = tiny_hf("actor", 512)
    layout = Qwen3Layout.from_hf_config(config, "actor")
    shards = hf_to_megatron(sd, layout, tp)
    q, k, v = (sd[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    hd, per_group, groups = 32, 2, 2
    rows = []  # q1 q2 k1 v1 | q3 q4 k2 v2, one row at a time
    for g in range(groups):
        for h in range(g * per_group, (g + 1) * per_group):
            rows.extend(q[h * hd + i] for i in range(hd))
        rows.extend(k[g * hd + i] for i in range(hd))
        rows.extend(v[g * hd + i] for i in range(hd))
    per_rank = len(rows) // tp
    for rank in range(tp):
        want = torch.stack(rows[rank * per_rank:(rank + 1) * per_rank])
        assert torch.equal(shards[rank]["decoder.layers.1.self_attention.linear_qkv.weight"], want)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fc1_and_row_layouts(tp):
    config, sd = tiny_hf("critic", 512, kv_heads=4)
    layout = Qwen3Layout.from_hf_config(config, "critic")
    shards = hf_to_megatron(sd, layout, tp)
    gate, up, down = (sd[f"model.layers.0.mlp.{x}_proj.weight"] for x in ("gate", "up", "down"))
    n = 128 // tp
    for rank, shard in enumerate(shards):
        fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"]
        assert torch.equal(fc1[:n], gate[rank * n:(rank + 1) * n]) and torch.equal(fc1[n:], up[rank * n:(rank + 1) * n])
        assert torch.equal(shard["decoder.layers.0.mlp.linear_fc2.weight"], down[:, rank * n:(rank + 1) * n])
        assert torch.equal(shard["output_layer.weight"], sd["score.weight"])
        assert torch.equal(shard["output_layer.bias"], sd["score.bias"])


@pytest.mark.parametrize(("vocab", "tp", "padded"), [(512, 1, 512), (512, 2, 512), (512, 4, 512),
                                                      (1000, 1, 1024), (1000, 2, 1024), (1000, 4, 1024),
                                                      (512, 8, 1024)])
def test_padded_vocab_and_rows(vocab, tp, padded):
    layout = Qwen3Layout(role="actor", num_layers=1, hidden_size=8, num_heads=8, num_kv_heads=8, head_dim=4,
                         intermediate_size=16, vocab_size=vocab, tie_word_embeddings=False)
    assert layout.padded_vocab(tp) == padded
    shards = hf_to_megatron({n: torch.randn(s) for n, s in _shapes(layout).items()}, layout, tp)
    pad_total = 0
    for rank, shard in enumerate(shards):
        assert shard["embedding.word_embeddings.weight"].shape == (padded // tp, 8)
        rows = padded_rows(shard, layout, tp, rank)
        for t in rows.values():
            assert torch.count_nonzero(t) == 0
        pad_total += rows.get("model.embed_tokens.weight", torch.empty(0, 8)).shape[0]
        assert set(rows) in (set(), {"model.embed_tokens.weight", "lm_head.weight"})
    assert pad_total == padded - vocab


def _shapes(layout: Qwen3Layout) -> dict[str, tuple[int, ...]]:
    h, hd, ffn, nq, nkv = (layout.hidden_size, layout.head_dim, layout.intermediate_size, layout.num_heads,
                           layout.num_kv_heads)
    out = {"model.embed_tokens.weight": (layout.vocab_size, h), "lm_head.weight": (layout.vocab_size, h),
           "model.norm.weight": (h,)}
    for i in range(layout.num_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (nq * hd, h), p + "self_attn.k_proj.weight": (nkv * hd, h),
                p + "self_attn.v_proj.weight": (nkv * hd, h), p + "self_attn.o_proj.weight": (h, nq * hd),
                p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                p + "mlp.down_proj.weight": (h, ffn)}
    return out


def test_transformers_critic_score_has_bias():
    config, sd = tiny_hf("critic", 512)
    assert "score.bias" in sd and sd["score.bias"].shape == (1,)
    layout = Qwen3Layout.from_hf_config(config, "critic")
    assert layout.value_bias and "output_layer.bias" in conversion_plan(layout)
    config, sd = tiny_hf("critic", 512, bias=False)
    layout = Qwen3Layout.from_hf_config(config, "critic")
    assert "score.bias" not in sd and "output_layer.bias" not in conversion_plan(layout)
    assert set(megatron_to_hf(hf_to_megatron(sd, layout, 2), layout)) == set(sd)


def test_refuses_missing_and_unknown_hf_keys():
    config, sd = tiny_hf("actor", 512)
    layout = Qwen3Layout.from_hf_config(config, "actor")
    broken = {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.k_norm.weight"}
    broken["model.layers.1.self_attn.rotary.inv_freq"] = torch.ones(4)
    with pytest.raises(EngineError, match=r"missing model\.layers\.1\.self_attn\.k_norm\.weight; "
                                          r"unknown model\.layers\.1\.self_attn\.rotary\.inv_freq"):
        hf_to_megatron(broken, layout, 2)


def test_refuses_tp_megatron_cannot_shard():
    config, sd = tiny_hf("actor", 512, kv_heads=4)
    layout = Qwen3Layout.from_hf_config(config, "actor")
    with pytest.raises(EngineError, match=r"tp 3 does not divide num_heads 4"):
        hf_to_megatron(sd, layout, 3)
    odd = Qwen3Layout(role="actor", num_layers=1, hidden_size=8, num_heads=12, num_kv_heads=3, head_dim=4,
                      intermediate_size=16, vocab_size=64, tie_word_embeddings=False)
    with pytest.raises(EngineError, match=r"tp 2 is neither a divisor nor a multiple of num_kv_heads 3"):
        odd.check_tp(2)


def test_refuses_tied_lm_head_that_differs():
    config, sd = tiny_hf("actor", 512, tie=True)
    layout = Qwen3Layout.from_hf_config(config, "actor")
    same = sd | {"lm_head.weight": sd["model.embed_tokens.weight"].clone()}
    assert set(megatron_to_hf(hf_to_megatron(same, layout, 1), layout)) == set(sd)
    with pytest.raises(EngineError, match="lm_head.weight differs"):
        hf_to_megatron(sd | {"lm_head.weight": torch.zeros_like(sd["model.embed_tokens.weight"])}, layout, 1)


def test_megatron_side_refusals_and_extra_state():
    config, sd = tiny_hf("critic", 1000)
    layout = Qwen3Layout.from_hf_config(config, "critic")
    shards = hf_to_megatron(sd, layout, 2)
    # Megatron's local layers carry None _extra_state; TransformerEngine's carry serialized bytes.
    shards[0]["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None
    shards[1]["decoder.layers.0.self_attention.linear_qkv._extra_state"] = torch.zeros(5, dtype=torch.uint8)
    shards[1]["decoder.layers.0.mlp.linear_fc1._extra_state"] = io.BytesIO(b"fp8 meta")
    notes: list[str] = []
    back = megatron_to_hf(shards, layout, notes)
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    assert len(notes) == 2 and "rank 1: skipped 2 _extra_state" in notes[1]

    real = [dict(s) for s in shards]
    real[1]["output_layer._extra_state"] = torch.ones(3)
    with pytest.raises(EngineError, match=r"output_layer\._extra_state on rank 1 holds a torch.float32 tensor"):
        megatron_to_hf(real, layout)

    missing = [dict(s) for s in shards]
    del missing[1]["decoder.layers.1.mlp.linear_fc2.weight"]
    missing[1]["decoder.layers.1.mlp.router.weight"] = torch.ones(2)
    with pytest.raises(EngineError, match=r"rank 1/2: missing decoder\.layers\.1\.mlp\.linear_fc2\.weight; "
                                          r"unknown decoder\.layers\.1\.mlp\.router\.weight"):
        megatron_to_hf(missing, layout)

    wrong = [dict(s) for s in shards]
    wrong[0]["embedding.word_embeddings.weight"] = wrong[0]["embedding.word_embeddings.weight"][:-1]
    with pytest.raises(EngineError, match=r"embedding\.word_embeddings\.weight on rank 0/2 has shape \(511, 64\)"):
        megatron_to_hf(wrong, layout)


def tiny_moe_hf(tie: bool = False, dtype=torch.float32, **moe):
    """A tiny random HF Qwen3-MoE actor (2 layers, 4 experts of intermediate 32, top-2), every tensor random; its
    parameters as the model holds them (fused experts.gate_up_proj and experts.down_proj)."""
    config = transformers.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=32, intermediate_size=128,
                                         moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                         norm_topk_prob=True, vocab_size=1000, tie_word_embeddings=tie,
                                         **({"decoder_sparse_step": 1, "mlp_only_layers": []} | moe))
    torch.manual_seed(3)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return config, {n: p.detach().to(dtype) for n, p in model.named_parameters()}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_moe_round_trip_bit_exact(tp):
    config, sd = tiny_moe_hf()
    layout = Qwen3Layout.from_hf_config(config, "actor")
    assert (layout.num_experts, layout.moe_top_k, layout.moe_intermediate_size) == (4, 2, 32)
    assert set(hf_names(layout)) == set(sd)  # the model's own parameter names: fused experts
    shards = hf_to_megatron(sd, layout, tp)
    assert all(set(s) == set(conversion_plan(layout)) for s in shards)
    assert "decoder.layers.1.mlp.router.weight" in shards[0] and "decoder.layers.1.mlp.linear_fc1.weight" not in shards[0]
    back = megatron_to_hf(shards, layout)
    assert list(back) == hf_names(layout)
    for name, t in sd.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_moe_expert_layout_matches_slow_loop(tp):
    """Expert e of rank r: linear_fc1 = [gate rows of r; up rows of r] of gate_up_proj[e] (gate rows first),
    linear_fc2 = the r-th column block of down_proj[e]; the router whole on every rank."""
    config, sd = tiny_moe_hf()
    layout = Qwen3Layout.from_hf_config(config, "actor")
    shards = hf_to_megatron(sd, layout, tp)
    fused, down = sd["model.layers.1.mlp.experts.gate_up_proj"], sd["model.layers.1.mlp.experts.down_proj"]
    n = 32 // tp
    for rank, shard in enumerate(shards):
        assert torch.equal(shard["decoder.layers.1.mlp.router.weight"], sd["model.layers.1.mlp.gate.weight"])
        for e in range(4):
            gate = torch.stack([fused[e, i] for i in range(rank * n, (rank + 1) * n)])
            up = torch.stack([fused[e, 32 + i] for i in range(rank * n, (rank + 1) * n)])
            prefix = f"decoder.layers.1.mlp.experts.local_experts.{e}."
            assert torch.equal(shard[prefix + "linear_fc1.weight"], torch.cat([gate, up]))
            cols = torch.stack([down[e][:, j] for j in range(rank * n, (rank + 1) * n)], dim=1)
            assert torch.equal(shard[prefix + "linear_fc2.weight"], cols)


def test_moe_negative_controls_break_the_round_trip():
    """Experts merged back in another order, or gate and up exchanged, must not give the model's tensors back."""
    config, sd = tiny_moe_hf()
    layout = Qwen3Layout.from_hf_config(config, "actor")
    shards = hf_to_megatron(sd, layout, 2)
    mirrored = [{k.replace("local_experts.0.", "local_experts.#.").replace("local_experts.3.", "local_experts.0.")
                 .replace("local_experts.#.", "local_experts.3."): v for k, v in s.items()} for s in shards]
    back = megatron_to_hf(mirrored, layout)
    assert not torch.equal(back["model.layers.0.mlp.experts.down_proj"], sd["model.layers.0.mlp.experts.down_proj"])
    fused = sd["model.layers.0.mlp.experts.gate_up_proj"]
    swapped = hf_to_megatron(sd | {"model.layers.0.mlp.experts.gate_up_proj": fused.roll(32, dims=1)}, layout, 1)
    assert not torch.equal(swapped[0]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"],
                           shards[0]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"])


def test_moe_refusals():
    config, _ = tiny_moe_hf(mlp_only_layers=[1])
    with pytest.raises(EngineError, match=r"every layer is sparse; this one has mlp_only_layers \[1\]"):
        Qwen3Layout.from_hf_config(config, "actor")
    config, _ = tiny_moe_hf(decoder_sparse_step=2)
    with pytest.raises(EngineError, match="decoder_sparse_step 2"):
        Qwen3Layout.from_hf_config(config, "actor")
    layout = Qwen3Layout(role="actor", num_layers=1, hidden_size=8, num_heads=8, num_kv_heads=8, head_dim=4,
                         intermediate_size=16, vocab_size=64, tie_word_embeddings=False, num_experts=4, moe_top_k=2,
                         moe_intermediate_size=12)
    with pytest.raises(EngineError, match="tp 8 does not divide moe_intermediate_size 12"):
        layout.check_tp(8)
    with pytest.raises(EngineError, match="moe_top_k 5 must be in 1..num_experts 4"):
        Qwen3Layout(role="actor", num_layers=1, hidden_size=8, num_heads=8, num_kv_heads=8, head_dim=4,
                    intermediate_size=16, vocab_size=64, tie_word_embeddings=False, num_experts=4, moe_top_k=5)
