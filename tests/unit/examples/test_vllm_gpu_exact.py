"""qualify.examples.vllm_gpu_exact off the GPU: the parts that do not need vLLM's CUDA kernels.

- The vLLM-shaped Qwen3 forward (flattened tokens, merged q/k/v and gate/up GEMMs, the first norm alone and every
  later one fused with the residual add, per-head q/k norms, neox rotary at each row's positions, causal attention per
  row) with the reference formula of every kernel gives Hugging Face's logits and gradients in fp32 to rounding; the
  negative controls (a rotary of the other style, the q/k norms left out, rows attending across each other) do not.
- Kernel: the forward's values are the fast function's, the gradient is the reference's.
- The exact tier's layers (exact_layer_outputs): vLLM's hidden + residual per layer are HF's residual stream.
- The sampler formula: vLLM's (fp32 logits / T, log_softmax) equals qualify's sampler_logprobs bit for bit.
- How the rollout was sampled is read from its rollout.json, and a CPU case is refused before anything runs.
The CUDA kernels themselves are measured on the GPU (benchmarks/gpu_vllm_chain.sh exact, BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from qualify.errors import EngineError
from qualify.examples.vllm_gpu_exact import (
    Kernels,
    VllmGpuExactEngine,
    kernel,
    rollout_mode,
    rope_cache,
    sampler_logprobs,
    torch_kernels,
    torch_rotary,
    vllm_forward,
)
from qualify.matrix import TinyModel
from qualify.store import write_json

SPEC = TinyModel(seed=7, vocab_size=96, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model():
    from qualify.models.tiny import build_tiny_model

    torch.manual_seed(0)
    m = build_tiny_model(SPEC, "actor").float().eval()
    with torch.no_grad():  # norms away from 1 so that leaving one out shows
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m


def ids() -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (3, 12), generator=torch.Generator().manual_seed(2))


def gap(model, kernels: Kernels) -> tuple[float, float]:
    """(max |logits - HF's| relative to HF's max, the same for every parameter's gradient of the summed logprobs)."""
    x = ids()
    model.zero_grad(set_to_none=True)
    hf = model(input_ids=x, use_cache=False).logits
    hf.float().log_softmax(-1).sum().backward()
    hf_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    cache = rope_cache(model.config, torch.float32, torch.device("cpu"))
    mine = vllm_forward(model, x, kernels, cache)
    mine.float().log_softmax(-1).sum().backward()
    logits = float((mine - hf).detach().abs().max() / hf.detach().abs().max())
    grads = max(float((p.grad - hf_grads[n]).abs().max() / hf_grads[n].abs().max().clamp_min(1e-30))
                if p.grad is not None else float("inf") for n, p in model.named_parameters())
    model.zero_grad(set_to_none=True)
    return logits, grads


def test_the_vllm_shaped_forward_is_hugging_faces_qwen3(model):
    logits, grads = gap(model, torch_kernels())
    assert logits < 1e-5 and grads < 1e-4, (logits, grads)


@pytest.mark.parametrize("bug", ["rotary_other_style", "no_qk_norm", "rows_attend_across"])
def test_a_miswired_forward_is_not(model, bug):
    k = torch_kernels()
    if bug == "rotary_other_style":  # GPT-J style: interleaved pairs instead of halves
        def rotary(positions, q, kk, cache, dim):
            def inter(x):
                return x.view(x.shape[0], -1, dim // 2, 2).transpose(-1, -2).reshape(x.shape)
            rq, rk = torch_rotary(positions, inter(q), inter(kk), cache, dim)
            return rq, rk
        k = replace(k, rotary=rotary)
    elif bug == "no_qk_norm":
        plain = k.rms_norm
        k = replace(k, rms_norm=lambda x, w, eps: x if x.dim() == 3 else plain(x, w, eps))
    else:
        attend = k.attention
        k = replace(k, attention=lambda q, kk, v, rows, scale: attend(q, kk, v, 1, scale))
    logits, _ = gap(model, k)
    assert logits > 1e-3, (bug, logits)


def test_kernel_takes_the_fast_values_and_the_reference_gradient():
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)

    def reference(x, w):
        return torch.tanh(x) * w

    def fast(x, w):  # the same values, one rounding off, and no gradient of its own
        return (torch.tanh(x) * w).float().double()

    out = kernel(fast, reference, x, w)
    assert torch.equal(out, fast(x, w).detach())
    g = torch.randn(5, 7, dtype=torch.float64)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    rx, rw = torch.autograd.grad(reference(x, w), (x, w), g)
    assert torch.equal(gx, rx) and torch.equal(gw, rw)
    # tuple outputs, one of them unused downstream
    a, _ = kernel(lambda x: (x * 2, x.float().double()), lambda x: (x * 2, x), x)
    (gx,) = torch.autograd.grad(a.sum(), (x,))
    assert torch.equal(gx, torch.full_like(x, 2.0))


def test_vllms_sampler_formula_is_qualifys():
    from qualify.ppo.logprob import sampler_logprobs as qualify_logprobs

    logits = torch.randn(2, 9, 40, dtype=torch.bfloat16)
    tokens = torch.randint(0, 33, (2, 9))
    for t in (1.0, 0.7):
        mine = sampler_logprobs(logits, tokens, t, 33, 4, lambda z: torch.log_softmax(z, dim=-1))
        theirs = qualify_logprobs(logits[:, :-1], tokens[:, 1:], t, 5, 33)
        assert torch.equal(mine[:, 1:], theirs) and torch.equal(mine[:, 0], torch.zeros(2))


def test_the_rollouts_own_token_logprob_kernel_replaces_the_formula():
    """A rollout sampled by vLLM's V2 runner is replayed with its own logprob kernel (Kernels.token_logprobs, GPU only);
    sampler_logprobs hands it each chunk's logits in the model's dtype, the chunk's tokens and T, and places what it
    returns where the formula's values would go. The formula itself (formula_token_logprobs) is qualify's sampler
    formula, bit for bit."""
    from qualify.examples.vllm_gpu_exact import formula_token_logprobs, torch_log_softmax

    logits = torch.randn(3, 7, 40, dtype=torch.bfloat16)
    tokens = torch.randint(0, 33, (3, 7))
    seen = []

    def kernel(z, ids, t):  # the formula, computed as a kernel would be handed it
        seen.append((z.dtype, tuple(z.shape), tuple(ids.shape), t))
        return formula_token_logprobs(z, ids, t, torch_log_softmax)

    formula = sampler_logprobs(logits, tokens, 0.7, 33, 5, torch_log_softmax)
    assert torch.equal(sampler_logprobs(logits, tokens, 0.7, 33, 5, torch_log_softmax, kernel), formula)
    assert seen[0] == (torch.bfloat16, (5, 33), (5, 1), 0.7) and sum(s[1][0] for s in seen) == 3 * 6

    def one_step_off(z, ids, t):  # a kernel whose reduction rounds otherwise: its values are what the rows hold
        return torch.nextafter(formula_token_logprobs(z, ids, t, torch_log_softmax), torch.tensor(0.0))

    off = sampler_logprobs(logits, tokens, 0.7, 33, 5, torch_log_softmax, one_step_off)
    assert (off[:, 1:] != formula[:, 1:]).all() and torch.equal(off[:, 0], torch.zeros(3))


def test_how_the_rollout_was_sampled_is_read_from_its_rollout_json(tmp_path):
    write_json(tmp_path / "rollout.json", {"sampling": {"dtype": "bfloat16"}, "block_size": 16,
                                           "batch_invariant": {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}})
    assert rollout_mode(tmp_path) == rollout_mode(tmp_path).__class__("bfloat16", True, 16)
    write_json(tmp_path / "rollout.json", {"sampling": {"dtype": "float32"}, "env": {"VLLM_BATCH_INVARIANT": "1"}})
    mode = rollout_mode(tmp_path)
    assert mode.batch_invariant and mode.block_size == 32 and mode.dtype == "float32"
    write_json(tmp_path / "rollout.json", {"sampling": {"dtype": "bfloat16"}, "env": {}})
    assert not rollout_mode(tmp_path).batch_invariant
    for runner in ("v1", "v2"):
        write_json(tmp_path / "rollout.json", {"sampling": {"dtype": "bfloat16"}, "model_runner": runner})
        assert rollout_mode(tmp_path).runner == runner
    write_json(tmp_path / "rollout.json", {"sampling": {"dtype": "bfloat16"}, "model_runner": "v3"})
    with pytest.raises(EngineError, match="model_runner 'v3'"):
        rollout_mode(tmp_path)
    write_json(tmp_path / "rollout.json", {"version": 1})
    with pytest.raises(EngineError, match="sampling.dtype"):
        rollout_mode(tmp_path)
    with pytest.raises(EngineError, match="rollout.json"):
        rollout_mode(tmp_path / "missing")


def test_a_cpu_case_is_refused_before_anything_runs(tmp_path):
    from qualify.case.context import EngineContext
    from qualify.matrix import Optimizer

    ctx = EngineContext(role="actor", precision="bf16", tp=1, rank=0, device="cpu", model_dir=Path("nowhere"),
                        optimizer=Optimizer(), temperature=1.0, logprob_chunk_tokens=8, vocab_size=96,
                        work_dir=tmp_path, rollout_dir=tmp_path)
    with pytest.raises(EngineError, match="CUDA, TP1 and DP1 only"):
        VllmGpuExactEngine().setup(ctx)


@pytest.mark.parametrize("invariant", [True, False])
def test_a_rounds_rollout_records_what_the_engine_reads(tmp_path, invariant):
    """Each round's rollout.json (qualify.rounds.session.Session.rollout_meta) says how the round's rollout was sampled
    as the reference's capture does: a trainer computing with vLLM's kernels after a weight sync reads the same dtype,
    mode and KV block size (before, a round's rollout.json held only the version and vLLM's TP degree)."""
    from types import SimpleNamespace

    from qualify.matrix import load_matrix
    from qualify.rounds.session import Session

    m = load_matrix(Path(__file__).resolve().parents[3] / "benchmarks" / "gpu-tiny-exact.yaml")
    s = object.__new__(Session)
    s.settings = replace(m.case_settings, rollout=replace(m.case_settings.rollout, batch_invariant=invariant,
                                                          block_size=48))
    s.tp, s.sampling = 1, {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0}
    s.engine = SimpleNamespace(started={"model_runner": "v2"} | (
        {"batch_invariant": {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}} if invariant else {}))
    meta = s.rollout_meta(2)
    assert (meta["version"], meta["vllm_tp"], meta["sampling"]["temperature"]) == (2, 1, 1.0)
    write_json(tmp_path / "rollout.json", meta)
    assert rollout_mode(tmp_path) == rollout_mode(tmp_path).__class__("bfloat16", invariant, 48, "v2")


def test_every_gemm_goes_through_the_kernel_sets_linear(model):
    """In batch-invariant mode vLLM computes every linear layer and its LM head with its own Triton matmul: the forward
    must route each of its GEMMs (q/k/v, o, gate/up, down per layer, then the head) through Kernels.linear."""
    import torch.nn.functional as F

    shapes = []

    def counted(x, w):
        shapes.append(tuple(w.shape))
        return F.linear(x, w)

    k = replace(torch_kernels(), linear=counted)
    c = model.config
    with torch.no_grad():
        vllm_forward(model, ids(), k, rope_cache(c, torch.float32, torch.device("cpu")))
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = [(q + 2 * kv, c.hidden_size), (c.hidden_size, q), (2 * c.intermediate_size, c.hidden_size),
             (c.hidden_size, c.intermediate_size)]
    assert shapes == layer * c.num_hidden_layers + [(c.vocab_size, c.hidden_size)], shapes


def exact_engine_on_cpu(model, kernels: Kernels) -> VllmGpuExactEngine:
    """The engine's exact path without its CUDA setup: what setup() leaves for an actor in the rollout's dtype, with
    the reference formula of every kernel (the GPU's own kernels are measured on the GPU)."""
    from types import SimpleNamespace

    e = VllmGpuExactEngine()
    e.exact, e.compute, e.kernels, e.ctx = True, model, kernels, SimpleNamespace(device="cpu")
    e.cache = rope_cache(model.config, torch.float32, torch.device("cpu"))
    return e


def test_the_exact_forwards_layers_are_hugging_faces_residual_stream(model):
    """exact_layer_outputs (the exact tier's layers: vLLM's hidden + residual after each decoder layer, and the final
    norm) names the same tensors as HF's hooks, equal to rounding; a forward without the q/k norms parts from them in
    model.layers.0 already."""
    from qualify.case.context import Batch
    from qualify.models.hooks import capture_layer_outputs

    x = ids()
    batch = Batch(input_ids_BT=x, response_mask_BT=torch.ones_like(x, dtype=torch.bool))
    with torch.no_grad():
        hf = capture_layer_outputs(model, x)
        mine = exact_engine_on_cpu(model, torch_kernels()).exact_layer_outputs(batch)
    assert sorted(mine) == ["model.layers.0", "model.layers.1", "model.norm"]
    for name, t in mine.items():
        assert t.dtype == torch.float32 and t.shape == hf[name].shape, name
        assert float((t - hf[name]).abs().max() / hf[name].abs().max()) < 1e-5, name
    plain = torch_kernels().rms_norm
    bug = replace(torch_kernels(), rms_norm=lambda v, w, eps: v if v.dim() == 3 else plain(v, w, eps))
    with torch.no_grad():
        broken = exact_engine_on_cpu(model, bug).exact_layer_outputs(batch)
    first = hf["model.layers.0"]
    assert float((broken["model.layers.0"] - first).abs().max() / first.abs().max()) > 1e-3
