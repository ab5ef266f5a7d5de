"""The shards of qualify.engines.megatron_convert drive megatron-core's own parallel layers correctly.

Four CPU processes over gloo run megatron-core's SelfAttention (linear_qkv, its q/k/v split, q/k
layernorm, linear_proj), MLP (linear_fc1, swiglu, linear_fc2), VocabParallelEmbedding and a gathered
ColumnParallelLinear output layer at TP1, TP2 and TP4, loaded with our shards of a tiny random HF
Qwen3, and compare them with HF's modules on the same input. Negative control: the naive layouts
(plain [q; k; v] and [gate; up] concatenations, split in tp row blocks) must not match.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from qualify.case.ranks import free_port

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.engines

WORLD = 4
TPS = (1, 2, 4)
SEQ, BATCH = 5, 3


def tiny_hf(vocab: int):
    config = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, intermediate_size=128,
                                      vocab_size=vocab, tie_word_embeddings=False)
    torch.manual_seed(vocab)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return config, model


def expected_outputs(model, x_SBH: torch.Tensor, ids_SB: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF's per-head q/k/v (after q/k norm), o_proj, MLP, embedding and logits for x (S, B, H)."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    with torch.no_grad():
        q = attn.q_norm(attn.q_proj(x_SBH).unflatten(-1, (4, 32)))  # (S, B, heads, hd)
        k = attn.k_norm(attn.k_proj(x_SBH).unflatten(-1, (2, 32)))
        v = attn.v_proj(x_SBH).unflatten(-1, (2, 32))
        ctx = torch.randn(SEQ, BATCH, 4 * 32, generator=torch.Generator().manual_seed(7))
        return {"q": q, "k": k, "v": v, "ctx": ctx, "proj": attn.o_proj(ctx), "mlp": mlp(x_SBH),
                "embed": model.model.embed_tokens(ids_SB), "logits": model.lm_head(x_SBH)}


def naive_shards(hf: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """Wrong layouts a converter might produce: no group interleaving, no per-rank [gate; up]."""
    p = "model.layers.0."
    qkv = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).chunk(tp)
    fc1 = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]).chunk(tp)
    return [{"decoder.layers.0.self_attention.linear_qkv.weight": a.contiguous(),
             "decoder.layers.0.mlp.linear_fc1.weight": b.contiguous()} for a, b in zip(qkv, fc1, strict=True)]


def _worker(rank: int, port: int, hf_by_vocab: dict, expected_by_vocab: dict, inputs: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    # CPU shim: megatron-core allocates the qkv all-gather buffer (TP > query groups) on
    # torch.cuda.current_device(); a CPU tensor is the same buffer here.
    torch.cuda.current_device = lambda: "cpu"
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=WORLD)
    from megatron.core import parallel_state as ps

    results = {}
    for tp in TPS:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        tp_rank = ps.get_tensor_model_parallel_rank()
        for vocab, hf in hf_by_vocab.items():
            results[f"tp{tp}-v{vocab}"] = _check_layers(tp, tp_rank, hf, expected_by_vocab[vocab], inputs, vocab)
        ps.destroy_model_parallel()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    torch.distributed.destroy_process_group()


def _check_layers(tp, tp_rank, hf, want, inputs, vocab) -> dict[str, float]:
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from qualify.engines.megatron_convert import Qwen3Layout, hf_to_megatron

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               kv_channels=32, ffn_hidden_size=128, normalization="RMSNorm", layernorm_epsilon=1e-6,
                               qk_layernorm=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               tensor_model_parallel_size=tp, use_cpu_initialization=True,
                               gradient_accumulation_fusion=False, bias_activation_fusion=False)
    layer = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm").submodules
    attention = build_module(layer.self_attention, config=config, layer_number=1)
    mlp = build_module(layer.mlp, config=config)
    layout = Qwen3Layout(role="actor", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32,
                         intermediate_size=128, vocab_size=vocab, tie_word_embeddings=False)
    padded = layout.padded_vocab(tp)
    embedding = tensor_parallel.VocabParallelEmbedding(padded, 64, init_method=config.init_method, config=config)
    output = tensor_parallel.ColumnParallelLinear(64, padded, config=config, init_method=config.init_method,
                                                  bias=False, gather_output=True)
    shard = hf_to_megatron(hf, layout, tp)[tp_rank]
    _load(attention, shard, "decoder.layers.0.self_attention.")
    _load(mlp, shard, "decoder.layers.0.mlp.")
    _load(embedding, {"weight": shard["embedding.word_embeddings.weight"]}, "")
    _load(output, {"weight": shard["output_layer.weight"]}, "")

    x, ids = inputs["x"], inputs["ids"]
    heads, groups = _local_heads(tp, tp_rank)
    with torch.no_grad():
        q, k, v = attention.get_query_key_value_tensors(x)
        ctx_local = want["ctx"].unflatten(-1, (4, 32))[:, :, heads].flatten(-2)
        errors = {"q": _err(q, want["q"][:, :, heads]), "k": _err(k, want["k"][:, :, groups]),
                  "v": _err(v, want["v"][:, :, groups]), "proj": _err(attention.linear_proj(ctx_local)[0], want["proj"]),
                  "mlp": _err(mlp(x)[0], want["mlp"]), "embed": _err(embedding(ids), want["embed"]),
                  "logits": _err(output(x)[0][..., :vocab], want["logits"])}
        naive = naive_shards(hf, tp)[tp_rank]
        _load(attention, naive, "decoder.layers.0.self_attention.")
        _load(mlp, naive, "decoder.layers.0.mlp.")
        qn, kn, vn = attention.get_query_key_value_tensors(x)
        errors["naive_qkv"] = max(_err(qn, want["q"][:, :, heads]), _err(kn, want["k"][:, :, groups]),
                                  _err(vn, want["v"][:, :, groups]))
        errors["naive_mlp"] = _err(mlp(x)[0], want["mlp"])
    return errors


def _load(module: torch.nn.Module, shard: dict[str, torch.Tensor], prefix: str) -> None:
    with torch.no_grad():
        for name, param in module.named_parameters():
            if prefix + name in shard:
                assert param.shape == shard[prefix + name].shape, (name, param.shape)
                param.copy_(shard[prefix + name])


def _local_heads(tp: int, tp_rank: int) -> tuple[list[int], list[int]]:
    """Query heads and KV groups rank tp_rank computes (4 heads, 2 groups)."""
    heads = list(range(tp_rank * 4 // tp, (tp_rank + 1) * 4 // tp))
    groups = list(range(tp_rank * 2 // tp, (tp_rank + 1) * 2 // tp)) if tp <= 2 else [tp_rank // (tp // 2)]
    return heads, groups


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def layer_results(tmp_path_factory) -> dict[str, dict[str, float]]:
    out_dir = tmp_path_factory.mktemp("megatron_layers")
    hf_by_vocab, expected_by_vocab = {}, {}
    gen = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(SEQ, BATCH, 64, generator=gen), "ids": torch.randint(0, 512, (SEQ, BATCH), generator=gen)}
    for vocab in (512, 1000):
        _, model = tiny_hf(vocab)
        hf_by_vocab[vocab] = {k: v.clone() for k, v in model.state_dict().items()}
        expected_by_vocab[vocab] = expected_outputs(model, inputs["x"], inputs["ids"])
    # fork, not spawn: the children inherit the imported megatron-core (4 s per process to import).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    torch.multiprocessing.start_processes(_worker, args=(free_port(), hf_by_vocab, expected_by_vocab, inputs,
                                                         str(out_dir)), nprocs=WORLD, join=True, start_method="fork")
    per_rank = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {case: {m: max(r[case][m] for r in per_rank) for m in per_rank[0][case]} for case in per_rank[0]}


CASES = [f"tp{tp}-v{vocab}" for tp in TPS for vocab in (512, 1000)]


@pytest.mark.parametrize("case", CASES)
def test_megatron_layers_match_hf(layer_results, case):
    errors = layer_results[case]
    for metric in ("q", "k", "v", "proj", "mlp", "embed", "logits"):
        assert errors[metric] < 1e-5, (case, metric, errors[metric])


@pytest.mark.parametrize("case", CASES)
def test_negative_control_naive_layout_mismatches(layer_results, case):
    errors = layer_results[case]
    assert errors["naive_qkv"] > 0.1, (case, errors["naive_qkv"])
    if not case.startswith("tp1-"):  # at TP1, [gate; up] is the correct fc1 layout
        assert errors["naive_mlp"] > 0.1, (case, errors["naive_mlp"])


def test_engine_refuses_cpu_and_scaled_rope(tmp_path):
    from types import SimpleNamespace

    from qualify.engines.base import EngineContext
    from qualify.engines.megatron import MegatronEngine, rope_theta
    from qualify.errors import EngineError
    from qualify.matrix import Optimizer

    ctx = EngineContext(role="actor", precision="fp32", tp=1, rank=0, device="cpu", model_dir=tmp_path,
                        optimizer=Optimizer(), temperature=1.0, logprob_chunk_tokens=8, vocab_size=512,
                        work_dir=tmp_path)
    with pytest.raises(EngineError, match="needs a CUDA device"):
        MegatronEngine().setup(ctx)
    assert rope_theta(SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6})) == 1e6
    with pytest.raises(EngineError, match="RoPE type 'yarn' is not supported"):
        rope_theta(SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}))
