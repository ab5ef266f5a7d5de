"""Pure parts of qualify.rounds: vLLM shard layout of Qwen3, acknowledgment verification, digests, updates."""

from __future__ import annotations

import pytest
import torch

from qualify.errors import EvidenceError, QualifyError
from qualify.rounds.acks import ack_problems
from qualify.rounds.digests import tensor_digest, version_digest
from qualify.rounds.shards import expected_shard_digests, rank_shards
from qualify.rounds.weights import Version, apply_update

CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_size": 16,
          "intermediate_size": 24, "num_hidden_layers": 2, "vocab_size": 100, "tie_word_embeddings": False,
          "architectures": ["Qwen3ForCausalLM"]}


def hf_tensors(config=CONFIG, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, d, f, v = config["hidden_size"], config["head_dim"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
              "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
              "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
              "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    out = {f"model.layers.{i}.{n}": torch.randn(s, generator=g) for i in range(config["num_hidden_layers"])
           for n, s in shapes.items()}
    out |= {"model.embed_tokens.weight": torch.randn(v, h, generator=g), "lm_head.weight": torch.randn(v, h, generator=g),
            "model.norm.weight": torch.randn(h, generator=g)}
    return out


def slow_qkv(w, rank, tp, config=CONFIG):
    """Head by head: the rank's q heads, then the kv head(s) it serves (replicated when tp > kv heads)."""
    d, H, KV = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    heads = lambda t, i: t[i * d:(i + 1) * d]
    q = [heads(w["self_attn.q_proj.weight"], rank * (H // tp) + j) for j in range(H // tp)]
    kv_ids = [rank * KV // tp] if tp >= KV else [rank * (KV // tp) + j for j in range(KV // tp)]
    k = [heads(w["self_attn.k_proj.weight"], i) for i in kv_ids]
    v = [heads(w["self_attn.v_proj.weight"], i) for i in kv_ids]
    return torch.cat(q + k + v)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_match_a_head_by_head_layout(tp):
    hf = hf_tensors()
    for rank in range(tp):
        shards = dict(rank_shards(hf, CONFIG, rank, tp))
        w = {k.removeprefix("model.layers.1."): t for k, t in hf.items() if k.startswith("model.layers.1.")}
        assert torch.equal(shards["model.layers.1.self_attn.qkv_proj.weight"], slow_qkv(w, rank, tp))
        cols = [c for c in range(CONFIG["num_attention_heads"] * 8) if c // (32 // tp) == rank]
        assert torch.equal(shards["model.layers.1.self_attn.o_proj.weight"], w["self_attn.o_proj.weight"][:, cols])
        rows = slice(rank * 24 // tp, (rank + 1) * 24 // tp)
        assert torch.equal(shards["model.layers.1.mlp.gate_up_proj.weight"],
                           torch.cat([w["mlp.gate_proj.weight"][rows], w["mlp.up_proj.weight"][rows]]))
        assert torch.equal(shards["model.layers.1.mlp.down_proj.weight"], w["mlp.down_proj.weight"][:, rows])
        assert torch.equal(shards["model.norm.weight"], hf["model.norm.weight"])


MOE_CONFIG = CONFIG | {"architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 3, "moe_intermediate_size": 8,
                       "decoder_sparse_step": 1, "mlp_only_layers": [0]}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_moe_layers_router_is_replicated_and_each_expert_sharded_like_a_dense_mlp(tp):
    """Layer 0 dense (mlp_only_layers), layer 1 MoE: its fused w13 holds, expert by expert, the rank's gate rows then
    the same up rows; w2 the same columns of down; the router whole on every rank."""
    g = torch.Generator().manual_seed(1)
    hf = {k: t for k, t in hf_tensors().items() if not k.startswith("model.layers.1.mlp.")}
    hf["model.layers.1.mlp.gate.weight"] = torch.randn(3, 16, generator=g)
    for e in range(3):
        for proj, shape in (("gate", (8, 16)), ("up", (8, 16)), ("down", (16, 8))):
            hf[f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight"] = torch.randn(shape, generator=g)
    for rank in range(tp):
        shards = dict(rank_shards(hf, MOE_CONFIG, rank, tp))
        rows = slice(rank * 8 // tp, (rank + 1) * 8 // tp)
        expert = lambda e, proj: hf[f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight"]
        for e in range(3):
            assert torch.equal(shards["model.layers.1.mlp.experts.w13_weight"][e],
                               torch.cat([expert(e, "gate")[rows], expert(e, "up")[rows]]))
            assert torch.equal(shards["model.layers.1.mlp.experts.w2_weight"][e], expert(e, "down")[:, rows])
        assert torch.equal(shards["model.layers.1.mlp.gate.weight"], hf["model.layers.1.mlp.gate.weight"])
        assert "model.layers.0.mlp.gate_up_proj.weight" in shards and "model.layers.1.mlp.gate_up_proj.weight" not in shards
    with pytest.raises(QualifyError, match="no known vLLM Qwen3 layout"):  # an expert past num_local_experts
        list(rank_shards(hf | {"model.layers.1.mlp.experts.3.up_proj.weight": torch.zeros(8, 16)}, MOE_CONFIG, 0, 1))


def test_vocab_is_padded_to_64_and_split_with_zero_rows():
    hf = hf_tensors()  # vocab 100 -> padded 128
    r0, r1 = (dict(rank_shards(hf, CONFIG, r, 2))["lm_head.weight"] for r in (0, 1))
    assert r0.shape == r1.shape == (64, 16)
    assert torch.equal(r0, hf["lm_head.weight"][:64])
    assert torch.equal(r1[:36], hf["lm_head.weight"][64:]) and not r1[36:].any()
    assert dict(rank_shards(hf, CONFIG, 0, 1))["model.embed_tokens.weight"].shape == (128, 16)


def test_unknown_tensors_and_architectures_are_refused():
    with pytest.raises(QualifyError, match="no known vLLM Qwen3 layout"):
        list(rank_shards(hf_tensors() | {"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}, CONFIG, 0, 1))
    with pytest.raises(QualifyError, match="Qwen3ForCausalLM and Qwen3MoeForCausalLM only"):
        expected_shard_digests(hf_tensors(), CONFIG | {"architectures": ["LlamaForCausalLM"]}, 1, torch.float32)
    with pytest.raises(QualifyError, match="cannot shard"):
        list(rank_shards(hf_tensors(), CONFIG, 0, 3))


def acks_for(expected, version=1):
    return [{"rank": r, "version": version, "tensors": dict(e)} for r, e in enumerate(expected)]


def test_ack_problems_accepts_exactly_one_matching_ack_per_rank():
    expected = expected_shard_digests(hf_tensors(), CONFIG, 2, torch.float32)
    assert ack_problems(acks_for(expected), 1, expected) == []
    assert ack_problems(list(reversed(acks_for(expected))), 1, expected) == []


def test_ack_problems_names_every_defect():
    expected = expected_shard_digests(hf_tensors(), CONFIG, 2, torch.float32)
    acks = acks_for(expected)
    assert ack_problems(acks[:1], 1, expected) == ["rank 1: no acknowledgment"]
    assert ack_problems(acks + [dict(acks[0])], 1, expected) == ["rank 0: 2 acknowledgments (duplicate)"]
    assert ack_problems(acks, 2, expected) == [f"rank {r}: acknowledges version 1, installed 2" for r in (0, 1)]
    assert any("not a rank of TP2" in p for p in ack_problems(acks + [{"rank": 2, "version": 1}], 1, expected))
    bad = acks_for(expected)
    name = "model.layers.0.mlp.down_proj.weight"
    bad[1]["tensors"][name] = tensor_digest(torch.zeros(1))
    assert [p.split(" holds")[0] for p in ack_problems(bad, 1, expected)] == [f"rank 1: {name}"]
    del bad[1]["tensors"][name]
    bad[0]["tensors"]["extra.weight"] = "sha256:0"
    assert ack_problems(bad, 1, expected) == ["rank 0: extra.weight is not expected", f"rank 1: {name} missing"]


def test_digests_see_one_ulp_dtype_and_shape_but_not_the_sign_of_zero():
    t = torch.tensor([0.5, -0.0, 2.0])
    assert tensor_digest(t) == tensor_digest(torch.tensor([0.5, 0.0, 2.0]))
    assert tensor_digest(t) != tensor_digest(torch.nextafter(t, torch.full_like(t, 9.0)))
    assert tensor_digest(t) != tensor_digest(t.double()) != tensor_digest(t.view(3, 1))
    assert version_digest({"a": "x", "b": "y"}) == version_digest({"b": "y", "a": "x"})


def test_apply_update_is_name_for_name():
    prev = Version(0, None, {"a": torch.ones(2), "b": torch.zeros(3)}, {})
    new = apply_update(prev, {"a": torch.full((2,), 0.5), "b": torch.ones(3)})
    assert torch.equal(new["a"], torch.full((2,), 1.5)) and torch.equal(new["b"], torch.ones(3))
    with pytest.raises(EvidenceError, match="missing \\['b'\\]"):
        apply_update(prev, {"a": torch.ones(2)})
    with pytest.raises(EvidenceError, match="shapes differ"):
        apply_update(prev, {"a": torch.ones(3), "b": torch.ones(3)})


def test_a_tied_head_is_expected_to_hold_the_embedding_rows():
    config = CONFIG | {"tie_word_embeddings": True}
    hf = {k: v for k, v in hf_tensors().items() if k != "lm_head.weight"}
    shards = dict(rank_shards(hf, config, 1, 2))
    assert torch.equal(shards["lm_head.weight"], shards["model.embed_tokens.weight"])
    assert torch.equal(shards["lm_head.weight"][:36], hf["model.embed_tokens.weight"][64:])


def test_a_rounds_tp_degree_the_model_cannot_split_is_refused_before_vllm_starts(tmp_path):
    """--train-tp 3 on a model of 4 heads: refused when the options are made (it used to start vLLM, then seal a
    FAILED verdict), as the same value in the matrix's rounds section is refused when the matrix loads."""
    import pytest
    import yaml

    from qualify.errors import MatrixError, QualifyError
    from qualify.matrix import load_matrix
    from qualify.rounds.stage import rounds_options
    from tests.conftest import TINY

    matrix = load_matrix(TINY)
    with pytest.raises(QualifyError, match="rounds.train_tp 3 does not divide models.tiny.num_heads 4"):
        rounds_options(matrix, train_tp=3)
    with pytest.raises(QualifyError, match="rounds.vllm_tp 3 does not divide"):
        rounds_options(matrix, vllm_tp=3)
    assert rounds_options(matrix, train_tp=2).train_tp == 2
    data = yaml.safe_load(TINY.read_text())
    data["rounds"]["train_tp"] = 3
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(MatrixError, match="rounds.train_tp 3 does not divide"):
        load_matrix(tmp_path / "m.yaml")


def test_the_rounds_replay_row_counts_pairs_and_fails_a_trainer_that_cannot_show_its_routes():
    """A MoE round's training step: its replay records summed over steps; a trainer without a routes() hook (its
    records None) or a record that is not a count is 'not observed', which fails the row (nothing else in a rounds
    run judges the step's tensors); a step that replayed nothing has no row."""
    from qualify.case.meta import CaseMeta
    from qualify.rounds.checks import NOT_OBSERVED, ROUTES_REPLAYED, equal_row, routes_replayed

    def replayed(records):
        return routes_replayed(CaseMeta.from_json({"routing_replay": records}))

    counts = [{"differ": 0, "pairs": 600}, {"differ": 3, "pairs": 600, "first": "row 1"}]
    assert replayed(counts)[0] == 3 and "3 of 1200" in replayed(counts)[1]
    assert replayed([{"differ": 0, "pairs": 600}])[0] == 0
    for records in ([None, None], [{"differ": "x", "pairs": 600}]):
        value, note = replayed(records)
        row = equal_row(ROUTES_REPLAYED, 1, value, 0, note)
        assert value == NOT_OBSERVED and not row.passed and row.rule == "== 0"
    assert routes_replayed(CaseMeta.from_json({})) is None and replayed([]) is None and routes_replayed(None) is None
