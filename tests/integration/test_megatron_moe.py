"""The megatron engine's Qwen3-MoE conversion and routing replay drive megatron-core's own MoE layer (router, allgather
dispatcher, SequentialMLP experts) to HF's Qwen3MoeSparseMoeBlock, replaying a batch's routes.

Two CPU processes over gloo run megatron-core's MoELayer at TP1 and at TP2 (experts sharded over TP, sequence
parallel as megatron-core trains MoE under TP: each rank routes its own sequence chunk; the engine itself runs MoE at
TP1, whose local norms refuse sequence parallelism), loaded with our shards of a
tiny random HF Qwen3-MoE layer (4 experts, top-2; norm_topk_prob on and off), routes replayed through megatron-core's
RouterReplay (qualify.engines.megatron_moe.RouteRecorder; a NO_ROUTE token keeps the router's own top-k). Compared
with HF's block under the reference's replay (qualify.models.routing): the output, the recorded routes, router logits
and routing weights, and the gradients of the router and of every expert (the router's through the replayed weights,
recomputed from its live logits). Negative controls that must not match: the experts in reverse order, gate and up
swapped in the fused gate_up_proj, and the replay skipped.
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

WORLD = 2
SEQ, BATCH, HIDDEN, EXPERTS, TOP_K = 6, 3, 64, 4, 2
CASES = [(tp, norm) for tp in (1, 2) for norm in (True, False)]
MLP = "model.layers.0.mlp."


def tiny_moe(norm_topk_prob: bool, num_layers: int = 1, offset: float = 0.0):
    """A tiny random HF Qwen3-MoE (4 experts, top-2, every layer sparse); each tensor randn x 0.2, vectors (norms) plus
    offset."""
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_hidden_layers=num_layers, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=32, intermediate_size=128,
                                         moe_intermediate_size=32, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                         norm_topk_prob=norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                                         vocab_size=512, tie_word_embeddings=False)
    torch.manual_seed(11)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (offset if p.ndim == 1 else 0.0))
    return config, model


def replay_routes(gen: torch.Generator) -> torch.Tensor:
    """(B, S, 1 layer, top_k) int32: two distinct random experts a token (not the router's own choice, mostly); each
    row's last token NO_ROUTE, as a rollout's last sampled token."""
    first = torch.randint(0, EXPERTS, (BATCH, SEQ, 1), generator=gen)
    second = (first + 1 + torch.randint(0, EXPERTS - 1, (BATCH, SEQ, 1), generator=gen)) % EXPERTS
    routes = torch.stack([first, second], dim=-1).to(torch.int32)
    routes[:, -1] = -1
    return routes


def expected(model, x_SBH: torch.Tensor, g_SBH: torch.Tensor, routes_BSLK: torch.Tensor | None) -> dict:
    """HF's block under the reference's replay: output (S, B, H), routes (B, S, 1, K), router logits and weights,
    and the gradients of (output x g).sum() under the model's parameter names."""
    from qualify.models.routing import own_routes_BTLK, router_outputs, routing

    block = model.model.layers[0].mlp
    block.zero_grad(set_to_none=True)
    own, recorded = [], []
    with routing(block, routes_BSLK, own, recorded):
        out_BSH = block(x_SBH.transpose(0, 1).contiguous())
    (out_BSH * g_SBH.transpose(0, 1)).sum().backward()
    outs = router_outputs(recorded, BATCH, SEQ)
    used = own_routes_BTLK(own, BATCH, SEQ)
    if routes_BSLK is not None:
        used = torch.where(routes_BSLK < 0, used, routes_BSLK)
    grads = {MLP + n: p.grad.detach().clone() for n, p in block.named_parameters()}
    return {"out": out_BSH.detach().transpose(0, 1), "routes": used, **outs, "grads": grads}


def _worker(rank: int, port: int, models: dict, wants: dict, inputs: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    # CPU shim: megatron-core allocates its all-gather buffer and moves the router's weight to
    # torch.cuda.current_device(); a CPU tensor is the same buffer here.
    torch.cuda.current_device = lambda: "cpu"
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=WORLD)
    from megatron.core import parallel_state as ps

    results = {}
    for tp, norm in CASES:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        results[f"tp{tp}-norm{norm}"] = _check_layer(tp, ps.get_tensor_model_parallel_rank(), models[norm],
                                                     wants[norm], inputs)
        ps.destroy_model_parallel()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    torch.distributed.destroy_process_group()


def _moe_layer(config, tp: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from qualify.engines.megatron_convert import Qwen3Layout
    from qualify.engines.megatron_moe import define_router_gemm, moe_config

    define_router_gemm()
    layout = Qwen3Layout.from_hf_config(config, "actor")
    tc = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                           ffn_hidden_size=128, normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
                           activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
                           attention_dropout=0.0, tensor_model_parallel_size=tp, use_cpu_initialization=True,
                           gradient_accumulation_fusion=False, bias_activation_fusion=False,
                           sequence_parallel=tp > 1, **moe_config(layout))
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    return layout, build_module(spec.submodules.mlp, config=tc)


class _Decoder(torch.nn.Module):
    """What RouteRecorder reads of a GPTModel (decoder.layers[i].mlp) around one MoE layer."""

    def __init__(self, moe: torch.nn.Module) -> None:
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.decoder.layers[0].mlp = moe


def _check_layer(tp: int, tp_rank: int, hf: dict, want: dict, inputs: dict) -> dict[str, float]:
    from megatron.core import parallel_state as ps

    from qualify.engines.megatron_convert import hf_to_megatron
    from qualify.engines.megatron_moe import RouteRecorder

    layout, moe = _moe_layer(hf["config"], tp)
    params = hf["params"]
    shard = hf_to_megatron(params, layout, tp)[tp_rank]
    _load(moe, shard)
    group = ps.get_tensor_model_parallel_group()
    recorder = RouteRecorder(_Decoder(moe), tp, tp_rank, group)  # sequence parallel at TP2
    rows = slice(tp_rank * SEQ // tp, (tp_rank + 1) * SEQ // tp)  # sequence parallel: this rank's chunk
    x, g, routes = inputs["x"][rows], inputs["g"][rows], inputs["routes"]
    with recorder.replaying(routes):
        out = moe(x)[0]
    (out * g).sum().backward()
    router_grad = moe.router.weight.grad
    if tp > 1:  # a sequence-parallel replica's gradient is partial: finalize_model_grads sums it over TP
        torch.distributed.all_reduce(router_grad, group=group)
    grads = {n: p.grad for n, p in moe.named_parameters()}
    want_grads = hf_to_megatron(params | want["grads"], layout, tp)[tp_rank]
    errors = {"out": _err(out, want["out"][rows]),
              "routes": float((recorder.routes(BATCH, SEQ) != want["routes"]).sum()),
              "logits": _err(recorder.router_outputs(BATCH, SEQ)["router_logits_BTLE"], want["router_logits_BTLE"]),
              "weights": _err(recorder.router_outputs(BATCH, SEQ)["routing_weights_BTLK"],
                              want["routing_weights_BTLK"]),
              "grad_router": _err(grads["router.weight"], want_grads["decoder.layers.0.mlp.router.weight"]),
              "grad_experts": max(_err(t, want_grads["decoder.layers.0.mlp." + n])
                                  for n, t in grads.items() if n.startswith("experts."))}
    with torch.no_grad():
        with recorder.replaying(None):
            errors["no_replay"] = _err(moe(x)[0], want["out"][rows])
        _load(moe, {_reversed_expert(n): t for n, t in shard.items()})
        with recorder.replaying(routes):
            errors["reversed_experts"] = _err(moe(x)[0], want["out"][rows])
        swapped = dict(params)
        fused = swapped[MLP + "experts.gate_up_proj"]
        swapped[MLP + "experts.gate_up_proj"] = fused.roll(fused.shape[1] // 2, dims=1)
        _load(moe, hf_to_megatron(swapped, layout, tp)[tp_rank])
        with recorder.replaying(routes):
            errors["gate_up_swapped"] = _err(moe(x)[0], want["out"][rows])
    recorder.close()
    return errors


def _reversed_expert(name: str) -> str:
    """The name of the expert in the mirrored slot (expert e loaded as expert E - 1 - e)."""
    parts = name.split(".")
    if "local_experts" in parts:
        i = parts.index("local_experts") + 1
        parts[i] = str(EXPERTS - 1 - int(parts[i]))
    return ".".join(parts)


def _load(module: torch.nn.Module, shard: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in module.named_parameters():
            src = shard["decoder.layers.0.mlp." + name]
            assert param.shape == src.shape, (name, param.shape, src.shape)
            param.copy_(src)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return float((got.detach() - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory) -> dict[str, dict[str, float]]:
    from qualify.models.checkpoint import quiet_transformers

    quiet_transformers()
    out_dir = tmp_path_factory.mktemp("megatron_moe")
    gen = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(SEQ, BATCH, HIDDEN, generator=gen), "g": torch.randn(SEQ, BATCH, HIDDEN, generator=gen),
              "routes": replay_routes(gen)}
    models, wants = {}, {}
    for norm in (True, False):
        config, model = tiny_moe(norm)
        models[norm] = {"config": config, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
        wants[norm] = expected(model, inputs["x"], inputs["g"], inputs["routes"])
    with warnings.catch_warnings():  # fork, not spawn: the children inherit the imported megatron-core
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    torch.multiprocessing.start_processes(_worker, args=(free_port(), models, wants, inputs, str(out_dir)),
                                          nprocs=WORLD, join=True, start_method="fork")
    per_rank = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {case: {m: max(r[case][m] for r in per_rank) for m in per_rank[0][case]} for case in per_rank[0]}


@pytest.mark.parametrize(("tp", "norm"), CASES)
def test_megatron_moe_layer_replays_to_hf(moe_results, tp, norm):
    errors = moe_results[f"tp{tp}-norm{norm}"]
    assert errors["routes"] == 0, errors
    for metric in ("out", "logits", "weights", "grad_router", "grad_experts"):
        assert errors[metric] < 1e-5, (metric, errors)


@pytest.mark.parametrize(("tp", "norm"), CASES)
def test_negative_controls_do_not_match(moe_results, tp, norm):
    errors = moe_results[f"tp{tp}-norm{norm}"]
    for metric in ("no_replay", "reversed_experts", "gate_up_swapped"):
        assert errors[metric] > 1e-2, (metric, errors)


def _cpu_gpt_shims() -> None:
    """What megatron-core's GPTModel needs to run a forward and backward on CPU (the engine runs it on a GPU unpatched):
    its causal mask is made on "cuda", its attention forks the CUDA RNG tracker (dropout is 0 here)."""
    import contextlib
    import functools
    from types import SimpleNamespace

    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax

    torch.cuda.current_device = lambda: "cpu"
    fused_softmax.get_default_causal_mask = functools.cache(lambda sq: torch.ones(sq, sq).triu(1).bool())
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: SimpleNamespace(fork=lambda *a, **k: contextlib.nullcontext())


def _gpt_worker(rank: int, port: int, config, params: dict, want: dict, inputs: dict, out_dir: str) -> None:
    """The engine's own GPTModel of a Qwen3-MoE (transformer_config, _build_model, RouteRecorder) at TP1 on CPU: logits,
    routes, router outputs and every gradient (under the HF names megatron_to_hf gives) against HF's replay."""
    from types import SimpleNamespace

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    _cpu_gpt_shims()
    from megatron.core import parallel_state as ps

    from qualify.engines.megatron import MegatronEngine, transformer_config
    from qualify.engines.megatron_convert import Qwen3Layout, hf_to_megatron, megatron_to_hf
    from qualify.engines.megatron_moe import RouteRecorder, define_router_gemm

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    engine = MegatronEngine()
    engine.ctx = SimpleNamespace(tp=1, role="actor", precision="fp32", device="cpu")
    engine.layout = Qwen3Layout.from_hf_config(config, "actor")
    engine.config = transformer_config(config, engine.layout, engine.ctx)
    gpt = engine._build_model(config, hf_to_megatron(params, engine.layout, 1)[0])
    define_router_gemm()
    recorder = RouteRecorder(gpt)
    ids_BT, routes, w_BTV = inputs["ids"], inputs["routes"], inputs["w"]
    pos_BT = torch.arange(ids_BT.shape[1]).expand_as(ids_BT)
    with recorder.replaying(routes):
        logits_BTV = gpt(input_ids=ids_BT, position_ids=pos_BT, attention_mask=None, runtime_gather_output=True)
    (logits_BTV[..., :w_BTV.shape[-1]] * w_BTV).sum().backward()
    grads = megatron_to_hf([{n: p.grad for n, p in gpt.named_parameters()}], engine.layout)
    outs = recorder.router_outputs(*ids_BT.shape)
    errors = {"logits": _err(logits_BTV[..., :w_BTV.shape[-1]], want["logits"]),
              "routes": float((recorder.routes(*ids_BT.shape) != want["routes"]).sum()),
              "logits_router": _err(outs["router_logits_BTLE"], want["router_logits_BTLE"]),
              "weights": _err(outs["routing_weights_BTLK"], want["routing_weights_BTLK"]),
              "grads": max(_err(grads[n], g) for n, g in want["grads"].items()),
              "grad_names": float(sorted(grads) != sorted(want["grads"]))}
    with torch.no_grad(), recorder.replaying(None):
        errors["no_replay"] = _err(gpt(input_ids=ids_BT, position_ids=pos_BT, attention_mask=None,
                                       runtime_gather_output=True)[..., :w_BTV.shape[-1]], want["logits"])
    recorder.close()
    Path(out_dir, "gpt.json").write_text(json.dumps(errors))


def test_the_engines_gpt_model_replays_to_hf(tmp_path):
    """The whole model at TP1 (2 MoE layers): logits, routes, router outputs and gradients as HF's under replay;
    routing afresh instead (the replay skipped) does not give HF's replayed logits."""
    from qualify.models.routing import own_routes_BTLK, router_outputs, routing

    config, model = tiny_moe(True, num_layers=2, offset=1.0)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 512, (BATCH, SEQ), generator=gen)
    routes = torch.cat([replay_routes(gen), replay_routes(gen)], dim=2)  # (B, S, 2 layers, top_k)
    w = torch.randn(BATCH, SEQ, 512, generator=gen)
    own, recorded = [], []
    with routing(model, routes, own, recorded):
        logits = model(input_ids=ids).logits
    (logits * w).sum().backward()
    want = {"logits": logits.detach(), "routes": torch.where(routes < 0, own_routes_BTLK(own, BATCH, SEQ), routes),
            **router_outputs(recorded, BATCH, SEQ), "grads": {n: p.grad for n, p in model.named_parameters()}}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt  # noqa: F401
    torch.multiprocessing.start_processes(_gpt_worker, args=(free_port(), config, params, want,
                                                             {"ids": ids, "routes": routes, "w": w}, str(tmp_path)),
                                          nprocs=1, join=True, start_method="fork")
    errors = json.loads((tmp_path / "gpt.json").read_text())
    assert errors["routes"] == 0 and errors["grad_names"] == 0, errors
    for metric in ("logits", "logits_router", "weights", "grads"):
        assert errors[metric] < 1e-5, (metric, errors)
    assert errors["no_replay"] > 1e-2, errors
