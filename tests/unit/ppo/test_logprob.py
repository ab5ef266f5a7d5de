"""qualify.ppo.logprob: bitwise equal to vLLM's sampler formula, chunked, with the naive gradient.

The negative controls show that the equality tests can fail: each common mistake (a bf16
temperature, keeping TP padding columns, x * (1/T), dividing bf16 logits) changes the bits.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from qualify.ppo.logprob import SAMPLING_EPS, naive_sampler_logprobs, sampler_logprobs

B, T, VOCAB, PADDED = 3, 11, 1000, 1024  # 33 tokens; 24 TP padding columns
TEMPERATURES = [0.6, 0.7, 1.0, 1.3]


def assert_near(got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    """torch.testing.assert_close without its import of torch.distributed.tensor (seconds here)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got.shape, expected.shape)
    excess = (got - expected).abs() - (atol + rtol * expected.abs())
    assert not (excess > 0).any() and not got.isnan().any(), f"max |diff| {(got - expected).abs().max().item():.3g}"


def make_inputs(dtype=torch.bfloat16, seed=0, padded=PADDED, vocab=VOCAB):
    gen = torch.Generator().manual_seed(seed)
    logits_BTV = (4 * torch.randn(B, T, padded, generator=gen)).to(dtype)
    # Padding columns hold large values, as an untrained or garbage lm_head row would.
    logits_BTV[..., vocab:] = 20.0
    tokens_BT = torch.randint(0, vocab, (B, T), generator=gen)
    return logits_BTV, tokens_BT


def literal_formula(logits_BTV, tokens_BT, temperature, vocab_size):
    """The formula as first written down: out of place, a 0-d fp32 CPU temperature.

    Bitwise vLLM's on CPU only: on CUDA a CPU 0-d divisor makes torch multiply by 1/T (see
    test_cuda_divisor_must_live_on_the_device).
    """
    z_BTV = logits_BTV.float()[..., :vocab_size] / torch.tensor(temperature, dtype=torch.float32)
    return torch.log_softmax(z_BTV, -1).gather(-1, tokens_BT[..., None])[..., 0]


# --- forward: bitwise -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_chunked_is_bitwise_the_naive_formula(dtype, temperature):
    logits_BTV, tokens_BT = make_inputs(dtype)
    expected = naive_sampler_logprobs(logits_BTV, tokens_BT, temperature, VOCAB)
    assert torch.equal(expected, literal_formula(logits_BTV, tokens_BT, temperature, VOCAB))
    for chunk_tokens in (1, 5, B * T, 64):
        got = sampler_logprobs(logits_BTV, tokens_BT, temperature, chunk_tokens, VOCAB)
        assert got.dtype == torch.float32 and got.shape == (B, T)
        assert torch.equal(got, expected), chunk_tokens


def test_unpadded_vocab_and_noncontiguous_logits():
    logits_BTV, tokens_BT = make_inputs(torch.float32, padded=VOCAB)
    got = sampler_logprobs(logits_BTV, tokens_BT, 0.7, 4)
    assert torch.equal(got, literal_formula(logits_BTV, tokens_BT, 0.7, VOCAB))
    logits_TBV = logits_BTV.transpose(0, 1)  # not contiguous
    got_TB = sampler_logprobs(logits_TBV, tokens_BT.T, 0.7, 4)
    assert torch.equal(got_TB, got.T)


def test_logits_are_not_modified():
    # fp32 and unpadded: .to(float32) would alias the caller's tensor, and the division is in place.
    logits_BTV, tokens_BT = make_inputs(torch.float32, padded=VOCAB)
    before = logits_BTV.clone()
    sampler_logprobs(logits_BTV, tokens_BT, 0.7, 4).sum()
    naive_sampler_logprobs(logits_BTV, tokens_BT, 0.7).sum()
    assert torch.equal(logits_BTV, before)


def test_greedy_temperature_divides_by_one_like_vllm():
    logits_BTV, tokens_BT = make_inputs()
    at_one = sampler_logprobs(logits_BTV, tokens_BT, 1.0, 8, VOCAB)
    for greedy in (0.0, SAMPLING_EPS / 2):
        assert torch.equal(sampler_logprobs(logits_BTV, tokens_BT, greedy, 8, VOCAB), at_one)


def test_int32_tokens():
    logits_BTV, tokens_BT = make_inputs()
    got = sampler_logprobs(logits_BTV, tokens_BT.int(), 0.7, 8, VOCAB)
    assert torch.equal(got, sampler_logprobs(logits_BTV, tokens_BT, 0.7, 8, VOCAB))


def test_vllm_sampler_source_still_has_this_formula():
    """A tripwire on the installed vLLM: if its sampler changes the formula, this must change too.

    Reads the source without importing vllm (an import costs tens of seconds).
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    sample_dir = Path(spec.submodule_search_locations[0]) / "v1" / "sample"
    sampler = (sample_dir / "sampler.py").read_text()
    assert "_SAMPLING_EPS = 1e-5" in sampler
    assert "logits = logits.to(torch.float32)" in sampler
    assert "temp = torch.where(temp < _SAMPLING_EPS, 1.0, temp)" in sampler
    assert "return logits.div_(temp.unsqueeze(dim=1))" in sampler
    assert "return logits.log_softmax(dim=-1, dtype=torch.float32)" in sampler
    topk_topp = (sample_dir / "ops" / "topk_topp_sampler.py").read_text()
    assert "logits_to_return = logits.log_softmax(dim=-1, dtype=torch.float32)" in topk_topp


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_divisor_must_live_on_the_device():
    """vLLM divides by a (num_reqs, 1) fp32 CUDA tensor; a Python float or CPU 0-d divisor is x * (1/T)."""
    logits_BTV, tokens_BT = (t.cuda() for t in make_inputs())
    z_NV = logits_BTV[..., :VOCAB].float().reshape(-1, VOCAB)
    temp_N = torch.full((B * T,), 0.7, dtype=torch.float32, device="cuda")
    vllm_N = z_NV.clone().div_(temp_N.unsqueeze(1)).log_softmax(dim=-1, dtype=torch.float32)
    vllm_BT = vllm_N.gather(-1, tokens_BT.reshape(-1, 1)).view(B, T)
    for chunk_tokens in (1, 5, 64):
        assert torch.equal(sampler_logprobs(logits_BTV, tokens_BT, 0.7, chunk_tokens, VOCAB), vllm_BT)
    assert not torch.equal(z_NV / 0.7, z_NV / temp_N.unsqueeze(1))
    assert not torch.equal(literal_formula(logits_BTV, tokens_BT, 0.7, VOCAB), vllm_BT)


# --- negative controls ------------------------------------------------------------------------------


def test_negative_control_bf16_temperature_is_not_bitwise():
    logits_BTV, tokens_BT = make_inputs()
    expected = sampler_logprobs(logits_BTV, tokens_BT, 0.7, 5, VOCAB)
    flat_NV, flat_N = logits_BTV.reshape(-1, PADDED), tokens_BT.reshape(-1)
    temp_bf16 = torch.tensor(0.7, dtype=torch.bfloat16)  # 0.69921875
    chunks = [
        torch.log_softmax(flat_NV[s : s + 5, :VOCAB].float() / temp_bf16, -1).gather(-1, flat_N[s : s + 5, None])
        for s in range(0, B * T, 5)
    ]
    assert not torch.equal(torch.cat(chunks)[:, 0].view(B, T), expected)


def test_negative_control_keeping_padding_columns_differs():
    logits_BTV, tokens_BT = make_inputs()
    with_padding = literal_formula(logits_BTV, tokens_BT, 0.7, PADDED)
    expected = sampler_logprobs(logits_BTV, tokens_BT, 0.7, 5, VOCAB)
    assert (with_padding - expected).abs().min() > 1.0  # the padding columns take most of the mass


def test_negative_control_reciprocal_and_bf16_division_differ():
    logits_BTV, tokens_BT = make_inputs()
    expected = naive_sampler_logprobs(logits_BTV, tokens_BT, 0.7, VOCAB)
    z_BTV = logits_BTV.float()[..., :VOCAB]
    # x * (1/T): what torch computes on CUDA for a Python-float or CPU 0-d divisor.
    reciprocal = torch.log_softmax(z_BTV * (1 / torch.tensor(0.7)), -1).gather(-1, tokens_BT[..., None])[..., 0]
    assert not torch.equal(reciprocal, expected)
    # bf16 logits / a 0-d fp32 tensor stays bf16 (a 0-d tensor does not promote): cast first.
    divided_bf16 = logits_BTV[..., :VOCAB] / torch.tensor(0.7, dtype=torch.float32)
    assert divided_bf16.dtype == torch.bfloat16
    late_cast = torch.log_softmax(divided_bf16.float(), -1).gather(-1, tokens_BT[..., None])[..., 0]
    assert not torch.equal(late_cast, expected)


# --- backward ---------------------------------------------------------------------------------------


def test_gradcheck_fp64():
    gen = torch.Generator().manual_seed(0)
    logits_BTV = torch.randn(2, 3, 16, dtype=torch.float64, generator=gen).requires_grad_()
    tokens_BT = torch.randint(0, 13, (2, 3), generator=gen)
    torch.autograd.gradcheck(lambda x: sampler_logprobs(x, tokens_BT, 0.7, 4, 13), logits_BTV, fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 64])
def test_gradient_is_bitwise_the_naive_autograd_gradient(dtype, chunk_tokens):
    logits_BTV, tokens_BT = make_inputs(dtype)
    logits_BTV.requires_grad_()
    g_BT = torch.randn(
        B, T, generator=torch.Generator().manual_seed(1), dtype=torch.promote_types(dtype, torch.float32)
    )
    (got,) = torch.autograd.grad(sampler_logprobs(logits_BTV, tokens_BT, 0.7, chunk_tokens, VOCAB), logits_BTV, g_BT)
    (expected,) = torch.autograd.grad(naive_sampler_logprobs(logits_BTV, tokens_BT, 0.7, VOCAB), logits_BTV, g_BT)
    assert got.dtype == dtype
    assert torch.equal(got, expected)
    assert (got[..., VOCAB:] == 0).all()


def test_gradient_is_the_analytic_formula():
    logits_BTV, tokens_BT = make_inputs(torch.float64)
    logits_BTV.requires_grad_()
    g_BT = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (got,) = torch.autograd.grad(sampler_logprobs(logits_BTV, tokens_BT, 0.7, 5, VOCAB), logits_BTV, g_BT)
    temp = torch.tensor(0.7, dtype=torch.float32).item()  # the temperature is an fp32 number
    p_BTV = torch.softmax(logits_BTV.detach()[..., :VOCAB] / temp, -1)
    onehot_BTV = torch.nn.functional.one_hot(tokens_BT, VOCAB).double()
    expected = g_BT[..., None] * (onehot_BTV - p_BTV) / temp
    assert_near(got[..., :VOCAB], expected, rtol=1e-12, atol=1e-14)


# --- memory: no [tokens, vocab] fp32 tensor ---------------------------------------------------------


class LargestFloat32(TorchDispatchMode):
    """Records the largest float32 tensor any op produces, views included."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float32:
                self.numel = max(self.numel, leaf.numel())
        return out


def float32_saved_numel(fn) -> int:
    numels = []

    def pack(t):
        numels.append(t.numel() if t.dtype == torch.float32 else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, max(numels, default=0)


def test_chunked_never_holds_tokens_by_vocab_in_fp32():
    logits_BTV, tokens_BT = make_inputs()
    logits_BTV.requires_grad_()
    with LargestFloat32() as chunked:
        out, chunked_saved = float32_saved_numel(lambda: sampler_logprobs(logits_BTV, tokens_BT, 0.7, 4, VOCAB))
        out.sum().backward()
    assert chunked.numel <= 4 * VOCAB
    assert chunked_saved < B * T  # only the logits (bf16), the tokens and the 1x1 temperature
    # Positive control: the naive formula does hold (and save) the whole thing in fp32.
    with LargestFloat32() as naive:
        out, naive_saved = float32_saved_numel(lambda: naive_sampler_logprobs(logits_BTV, tokens_BT, 0.7, VOCAB))
        out.sum().backward()
    assert naive.numel >= B * T * VOCAB and naive_saved >= B * T * VOCAB


# --- an independent implementation: TRL --------------------------------------------------------------


@pytest.mark.slow
def test_matches_trl_selective_log_softmax():
    """TRL's selective_log_softmax (logsumexp-based for fp32) agrees to rounding, not bitwise."""
    pytest.importorskip("trl")
    from trl.trainer.utils import selective_log_softmax

    logits_BTV, tokens_BT = make_inputs(torch.float32, padded=VOCAB)
    ours = sampler_logprobs(logits_BTV, tokens_BT, 0.7, 5)
    trl_fp32 = selective_log_softmax(logits_BTV, tokens_BT, temperature=0.7)
    assert_near(trl_fp32, ours, rtol=1e-5, atol=1e-5)
    # On bf16 logits TRL divides and normalizes in bf16: not the sampler formula.
    trl_bf16 = selective_log_softmax(logits_BTV.bfloat16(), tokens_BT, temperature=0.7)
    assert trl_bf16.dtype == torch.bfloat16
    assert not torch.equal(trl_bf16.float(), sampler_logprobs(logits_BTV.bfloat16(), tokens_BT, 0.7, 5))
