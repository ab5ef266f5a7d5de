"""qualify.ppo.logprob.processed_logprobs: vLLM's processed logprobs under min-p, top-k and top-p.

Compared with a slow, obvious loop (Python sets and float64 sums, one token at a time); the kept
set must be exactly the loop's, the logprobs within fp32 rounding. With truncation off the result is
bitwise the full formula. Bitwise agreement with vLLM's own sampler code is in
tests/integration/test_sampling.py (it imports vLLM).
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

from qualify.ppo.logprob import processed_logprobs, sampler_logprobs
from tests.unit.ppo.test_logprob import LargestFloat32

B, T, VOCAB, PADDED = 3, 7, 200, 256
INF = float("inf")


def slow_token(logits_V: torch.Tensor, token: int, temperature: float, top_k: int, top_p: float, min_p: float):
    """(processed, full, log_kept_mass, kept_size) of one token, written the obvious way."""
    z = (logits_V.float() / torch.tensor(temperature, dtype=torch.float32)).tolist()  # the fp32 scaled logits
    V = len(z)
    kept = set(range(V))
    if min_p > 0:
        top = max(z)
        p = [math.exp(v - top) for v in z]
        total = sum(p)
        p = [x / total for x in p]
        kept = {i for i in kept if p[i] >= max(p) * min_p}
    if 0 < top_k < V:
        values = sorted((z[i] for i in kept), reverse=True)
        if top_k <= len(values):
            kept = {i for i in kept if z[i] >= values[top_k - 1]}
    if top_p < 1:
        top = max(z[i] for i in kept)
        weight = {i: math.exp(z[i] - top) for i in kept}
        total = sum(weight.values())
        ascending = sorted(kept, key=lambda i: z[i])  # stable: ties in index order
        cum, dropped = 0.0, set()
        for i in ascending[:-1]:  # the largest is always kept
            cum += weight[i] / total
            if cum <= 1 - top_p:
                dropped.add(i)
        kept -= dropped

    def log_sum_exp(indices):
        top = max(z[i] for i in indices)
        return top + math.log(sum(math.exp(z[i] - top) for i in indices))

    lse_all, lse_kept = log_sum_exp(range(V)), log_sum_exp(kept)
    processed = z[token] - lse_kept if token in kept else -INF
    return processed, z[token] - lse_all, (lse_kept - lse_all) if len(kept) < V else 0.0, len(kept)


def slow(logits_BTV, tokens_BT, vocab, **sampling):
    rows = [slow_token(logits_BTV[b, t, :vocab], int(tokens_BT[b, t]), **sampling)
            for b in range(tokens_BT.shape[0]) for t in range(tokens_BT.shape[1])]
    processed, full, mass, size = (torch.tensor(col).view(tokens_BT.shape) for col in zip(*rows, strict=True))
    return processed, full, mass, size.long()


def make_inputs(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits_BTV = (3 * torch.randn(B, T, PADDED, generator=gen)).to(dtype)
    logits_BTV[..., VOCAB:] = 30.0  # TP padding columns: would take all the mass if they were kept
    # Half the tokens are the row's argmax (always kept), half random (often cut).
    tokens_BT = torch.where(torch.rand(B, T, generator=gen) < 0.5, logits_BTV[..., :VOCAB].argmax(-1),
                            torch.randint(0, VOCAB, (B, T), generator=gen))
    return logits_BTV, tokens_BT


def assert_matches_slow(got, logits_BTV, tokens_BT, vocab=VOCAB, **sampling):
    processed, full, mass, size = slow(logits_BTV, tokens_BT, vocab, **sampling)
    assert torch.equal(got.kept_size, size), (got.kept_size, size)
    assert got.kept_size.dtype == torch.int64
    assert torch.equal(got.processed == -INF, processed == -INF)
    finite = processed != -INF
    for name, g, e in (("processed", got.processed[finite], processed[finite]), ("full", got.full, full),
                       ("log_kept_mass", got.log_kept_mass, mass)):
        assert g.dtype == torch.float32
        err = (g.double() - e.double()).abs().max().item() if g.numel() else 0.0
        assert err < 2e-5, (name, err)


SETTINGS = [
    {"temperature": 1.0, "top_k": -1, "top_p": 0.9, "min_p": 0.0},
    {"temperature": 0.6, "top_k": -1, "top_p": 0.9, "min_p": 0.0},
    {"temperature": 1.5, "top_k": -1, "top_p": 0.5, "min_p": 0.0},
    {"temperature": 0.8, "top_k": 20, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.0},
    {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.05},
    {"temperature": 1.3, "top_k": 50, "top_p": 0.8, "min_p": 0.02},
    {"temperature": 0.7, "top_k": 3, "top_p": 0.95, "min_p": 0.3},
]


@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_matches_the_slow_loop_and_chunking_does_not_matter(sampling):
    logits_BTV, tokens_BT = make_inputs()
    results = [processed_logprobs(logits_BTV, tokens_BT, chunk_tokens=c, vocab_size=VOCAB, **sampling)
               for c in (1, 4, B * T, 100)]
    assert_matches_slow(results[0], logits_BTV, tokens_BT, **sampling)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))
    first = results[0]
    assert (first.processed == -INF).any() and (first.processed[first.processed != -INF] >= first.full[
        first.processed != -INF]).all()  # renormalized over fewer tokens: never below the full formula
    assert (first.kept_size < VOCAB).all() and (first.log_kept_mass < 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("top_k", [-1, VOCAB, VOCAB + 5, 10**9])
def test_truncation_off_is_bitwise_the_full_formula(dtype, top_k):
    logits_BTV, tokens_BT = make_inputs(1, dtype)
    for temperature in (0.6, 1.0, 1.5):
        got = processed_logprobs(logits_BTV, tokens_BT, temperature=temperature, top_k=top_k, top_p=1.0,
                                 chunk_tokens=5, vocab_size=VOCAB)
        full = sampler_logprobs(logits_BTV, tokens_BT, temperature, 5, VOCAB)
        assert torch.equal(got.processed, full) and torch.equal(got.full, full)
        assert (got.kept_size == VOCAB).all() and (got.log_kept_mass == 0).all()


def test_full_is_bitwise_the_sampler_formula_under_truncation():
    logits_BTV, tokens_BT = make_inputs(2, torch.bfloat16)
    got = processed_logprobs(logits_BTV, tokens_BT, temperature=0.7, top_k=30, top_p=0.9, min_p=0.01,
                             chunk_tokens=4, vocab_size=VOCAB)
    assert torch.equal(got.full, sampler_logprobs(logits_BTV, tokens_BT, 0.7, 4, VOCAB))


def test_top_p_so_small_that_one_token_survives():
    logits_BTV, _tokens_BT = make_inputs(3)
    argmax_BT = logits_BTV[..., :VOCAB].argmax(-1)
    got = processed_logprobs(logits_BTV, argmax_BT, temperature=1.0, top_p=1e-6, chunk_tokens=8, vocab_size=VOCAB)
    assert (got.kept_size == 1).all() and (got.processed == 0).all()
    # 1 - 1e-9 is 1.0 in fp32: every cumsum is <= it, and only vLLM's "at least one" rule keeps the top token.
    tiny = processed_logprobs(logits_BTV, argmax_BT, temperature=1.0, top_p=1e-9, chunk_tokens=8, vocab_size=VOCAB)
    assert all(torch.equal(a, b) for a, b in zip(tiny, got, strict=True))
    assert torch.allclose(got.log_kept_mass, got.full, atol=1e-6)  # the kept mass is the argmax's probability
    others = processed_logprobs(logits_BTV, (argmax_BT + 1) % VOCAB, temperature=1.0, top_p=1e-6, chunk_tokens=8,
                                vocab_size=VOCAB)
    assert (others.processed == -INF).all()
    assert_matches_slow(others, logits_BTV, (argmax_BT + 1) % VOCAB, temperature=1.0, top_k=-1, top_p=1e-6,
                        min_p=0.0)


def test_top_k_larger_than_the_vocabulary_and_top_k_one():
    logits_BTV, tokens_BT = make_inputs(4)
    huge = processed_logprobs(logits_BTV, tokens_BT, temperature=0.9, top_k=VOCAB + 1, top_p=0.9, chunk_tokens=8,
                              vocab_size=VOCAB)
    no_k = processed_logprobs(logits_BTV, tokens_BT, temperature=0.9, top_p=0.9, chunk_tokens=8, vocab_size=VOCAB)
    assert all(torch.equal(a, b) for a, b in zip(huge, no_k, strict=True))
    one = processed_logprobs(logits_BTV, tokens_BT, temperature=0.9, top_k=1, chunk_tokens=8, vocab_size=VOCAB)
    assert (one.kept_size == 1).all()
    assert_matches_slow(one, logits_BTV, tokens_BT, temperature=0.9, top_k=1, top_p=1.0, min_p=0.0)


def tied_row(vocab: int, group: int, low: float = -3.0) -> torch.Tensor:
    """A (1, 1, vocab) row: vocab - group distinct logits and a tied group of `group` at `low`."""
    values = torch.linspace(-2.0, 4.0, vocab - group)
    return torch.cat([values[: (vocab - group) // 2], torch.full((group,), low), values[(vocab - group) // 2:]])[
        None, None]


def test_ties_at_the_top_k_boundary_are_all_kept():
    row = tied_row(64, 5, low=1.05)  # five tokens tied at 1.05, about the middle of the row
    z = row[0, 0]
    assert int((z == 1.05).sum()) == 5
    k = int((z > 1.05).sum()) + 2  # the k-th largest value is the tie: all five are kept, k + 3 in all
    tokens = torch.nonzero(z == 1.05)[:, 0][None]
    got = processed_logprobs(row.expand(1, 5, 64), tokens, temperature=1.0, top_k=k, chunk_tokens=2)
    assert (got.kept_size == k + 3).all() and torch.isfinite(got.processed).all()
    assert_matches_slow(got, row.expand(1, 5, 64), tokens, vocab=64, temperature=1.0, top_k=k, top_p=1.0, min_p=0.0)


@pytest.mark.parametrize("vocab", [16, 64, 512])  # up to 16 torch's CPU sort is an insertion sort; above, not stable
def test_ties_straddling_the_top_p_boundary(vocab):
    """The top-p cut falls inside a group of equal logits: the kept size, the kept mass and the logprob of a
    kept tied token are defined; which tied tokens survive is the sort's order, as in vLLM."""
    group = 6
    row = tied_row(vocab, group, low=-3.0)  # the tied group is the smallest values: the first cut
    z = row[0, 0]
    probs = torch.softmax(z.double(), -1)
    tied_p = probs[z == -3.0][0].item()
    lower = probs[z < -3.0].sum().item()
    top_p = 1 - (lower + 2.5 * tied_p)  # the cut keeps going through 2 of the 6 tied tokens, stops at the third
    tokens = torch.nonzero(z == -3.0)[:, 0][None]
    got = processed_logprobs(row.expand(1, group, vocab), tokens, temperature=1.0, top_p=top_p, chunk_tokens=3)
    expected = slow(row.expand(1, group, vocab), tokens, vocab, temperature=1.0, top_k=-1, top_p=top_p, min_p=0.0)
    assert (got.kept_size == vocab - (z < -3.0).sum() - 2).all() and torch.equal(got.kept_size, expected[3])
    survivors = torch.isfinite(got.processed[0])
    assert int(survivors.sum()) == group - 2  # exactly four of the six tied tokens are kept
    kept_value = expected[0][0][torch.isfinite(expected[0][0])][0].item()
    assert (got.processed[0][survivors] - kept_value).abs().max() < 1e-5
    assert (got.log_kept_mass - expected[2]).abs().max() < 1e-5


def test_exact_boundaries_are_vllms_inequalities():
    """Probabilities exact in fp32, so each cut lands exactly on its threshold: top-p drops a cumsum equal
    to 1 - p, min-p keeps a probability equal to min_p x the top."""
    flat = torch.zeros(1, 4, 4)  # four equal logits: softmax 0.25 each, ascending cumsum 0.25, 0.5, 0.75, 1.0
    tokens = torch.arange(4)[None]
    for top_p, kept in ((0.5, 2), (0.75, 3), (0.25, 1)):
        got = processed_logprobs(flat, tokens, temperature=1.0, top_p=top_p, chunk_tokens=2)
        assert (got.kept_size == kept).all() and int(torch.isfinite(got.processed).sum()) == kept, top_p
        assert_matches_slow(got, flat, tokens, vocab=4, temperature=1.0, top_k=-1, top_p=top_p, min_p=0.0)
    halves = torch.log(torch.tensor([2.0, 1.0, 1.0]))[None, None]  # softmax exactly 0.5, 0.25, 0.25
    got = processed_logprobs(halves.expand(1, 3, 3), torch.arange(3)[None], temperature=1.0, min_p=0.5,
                             chunk_tokens=3)
    assert (got.kept_size == 3).all() and torch.isfinite(got.processed).all()


def test_min_p_keeps_tokens_at_least_min_p_times_the_top():
    logits = torch.log(torch.tensor([[[0.5, 0.2, 0.1, 0.05, 0.1, 0.05]]]))  # min_p 0.2: the cut is p < 0.1
    tokens = torch.arange(6)[None]
    got = processed_logprobs(logits.expand(1, 6, 6), tokens, temperature=1.0, min_p=0.19, chunk_tokens=4)
    assert got.kept_size.tolist() == [[4] * 6]
    assert torch.isinf(got.processed[0, [3, 5]]).all() and torch.isfinite(got.processed[0, [0, 1, 2, 4]]).all()
    assert abs(got.processed[0, 0].item() - math.log(0.5 / 0.9)) < 1e-6
    assert abs(got.log_kept_mass[0, 0].item() - math.log(0.9)) < 1e-6


def test_the_order_matters_top_p_after_top_k_renormalization():
    """Negative control: top-p cuts the top-k-renormalized distribution, not the full one; here they differ."""
    logits = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1]]]))
    token = torch.tensor([[1]])
    # Full distribution, top-p 0.5: ascending cumsum 0.1, 0.3, 0.6, 1.0; the cut is <= 0.5, so {0, 1} stay.
    alone = processed_logprobs(logits, token, temperature=1.0, top_p=0.5, chunk_tokens=1)
    assert alone.kept_size.item() == 2 and abs(alone.processed.item() - math.log(0.3 / 0.7)) < 1e-6
    # vLLM: top-2 first, renormalized to (4/7, 3/7); cumsum 3/7 <= 0.5, so token 1 is cut as well.
    got = processed_logprobs(logits, token, temperature=1.0, top_k=2, top_p=0.5, chunk_tokens=1)
    assert got.kept_size.item() == 1 and got.processed.item() == -INF
    assert abs(got.log_kept_mass.item() - math.log(0.4)) < 1e-6
    assert_matches_slow(got, logits, token, vocab=4, temperature=1.0, top_k=2, top_p=0.5, min_p=0.0)


def test_logits_are_not_modified_and_padding_is_ignored():
    logits_BTV, tokens_BT = make_inputs(5)
    before = logits_BTV.clone()
    padded = processed_logprobs(logits_BTV, tokens_BT, temperature=0.8, top_k=40, top_p=0.9, min_p=0.01,
                                chunk_tokens=4, vocab_size=VOCAB)
    assert torch.equal(logits_BTV, before)
    unpadded = processed_logprobs(logits_BTV[..., :VOCAB].contiguous(), tokens_BT, temperature=0.8, top_k=40,
                                  top_p=0.9, min_p=0.01, chunk_tokens=4)
    assert all(torch.equal(a, b) for a, b in zip(padded, unpadded, strict=True))


def test_never_holds_tokens_by_vocab_in_fp32():
    logits_BTV, tokens_BT = make_inputs(6, torch.bfloat16)
    with LargestFloat32() as largest:
        processed_logprobs(logits_BTV, tokens_BT, temperature=0.8, top_k=40, top_p=0.9, min_p=0.01, chunk_tokens=4,
                           vocab_size=VOCAB)
    assert 0 < largest.numel <= 4 * VOCAB


def test_vllm_sampler_source_still_truncates_this_way():
    """A tripwire on the installed vLLM's CPU path: the order and the boundary rules this module copies."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    sample_dir = Path(spec.submodule_search_locations[0]) / "v1" / "sample"
    sampler = (sample_dir / "sampler.py").read_text()
    order = [sampler.index(s) for s in ("logits = self.apply_temperature(", ("for processor in sampling_metadata."
                                        "logitsprocs.argmax_invariant:"), "self.topk_topp_sampler(")]
    assert order == sorted(order)
    ops = (sample_dir / "ops" / "topk_topp_sampler.py").read_text()
    for line in ("logits_sort, logits_idx = logits.sort(dim=-1, descending=False)",
                 "top_k_mask = logits_sort < top_k_mask", "probs_sort = logits_sort.softmax(dim=-1)",
                 "probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)",
                 "top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)", "top_p_mask[:, -1] = False",
                 "return logits.masked_fill_(logits < top_k_mask, -float(\"inf\"))",
                 "return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=is_cpu)"):
        assert line in ops, line
    builtin = (sample_dir / "logits_processor" / "builtin.py").read_text()
    for line in ("probability_values = torch.nn.functional.softmax(logits, dim=-1)",
                 "adjusted_min_p = max_probabilities.mul_(self.min_p)",
                 "invalid_token_mask = probability_values < adjusted_min_p"):
        assert line in builtin, line


# --- the train-vs-rollout decomposition -------------------------------------------------------------


def test_decompose_mismatch_splits_numerics_from_truncation_and_lists_kept_set_differences():
    from qualify.reference.mismatch_text import mismatch_lines
    from qualify.reference.targets import decompose_mismatch

    processed = torch.tensor([-0.5, -1.0, -2.0, -INF, -0.25])
    full = processed - 0.1  # the kept mass is about 0.905 for every token
    full[3] = -7.0
    sampler = processed + torch.tensor([0.0, 1e-6, -2e-6, 0.0, 0.3])  # token 3: outside our kept set; 4: too far
    sampler[3] = -0.3
    where = torch.tensor([[0, 5], [0, 6], [1, 5], [1, 6], [2, 7]])
    report = decompose_mismatch(sampler, processed, full, where, limit=1e-4)
    assert report["num_tokens"] == 5 and report["num_not_bitwise"] == 4
    assert report["max_abs"] == pytest.approx(2e-6, rel=0.1)  # the two kept-set differences are left out
    assert report["truncation"]["num_truncated"] == 3 and report["truncation"]["max_abs"] == pytest.approx(0.1)
    assert report["total"]["num_not_bitwise"] == 5 and report["total"]["max_abs"] == pytest.approx(6.7)
    differs = report["kept_set_differs"]
    assert differs["count"] == 2 and [(t["row"], t["position"]) for t in differs["tokens"]] == [(1, 6), (2, 7)]
    assert differs["tokens"][0]["processed"] is None and differs["tokens"][1]["processed"] == -0.25
    lines = mismatch_lines("fp32", report)
    assert "1/5 tokens bitwise equal to the processed formula" in lines[0]
    assert "kept set differs" in lines[2] and "2 tokens" in lines[2]
    assert "row 1 position 6: sampler -0.3, reference processed -inf (outside its kept set)" in lines[3]
    assert "row 2 position 7" in lines[4] and len(lines) == 5
    many = {**report, "kept_set_differs": {**differs, "count": 4061, "tokens": differs["tokens"] * 2031}}
    listed = mismatch_lines("fp32", many)  # thousands at a real shape: the first few, and how many more
    assert len(listed) == 3 + 20 + 1 and listed[-1] == "      ... and 4042 more (reference.json lists every one)"
    import json

    json.dumps(report, allow_nan=False)  # the summary is strict JSON: no -inf anywhere


def test_decompose_mismatch_without_truncation_is_the_old_report():
    from qualify.reference.targets import decompose_mismatch

    logp = torch.tensor([-1.0, -2.0, -3.0])
    sampler = logp + torch.tensor([0.0, 0.0, 1e-6])
    report = decompose_mismatch(sampler, logp, logp, torch.zeros(3, 2, dtype=torch.long), limit=1e-4)
    assert report["num_not_bitwise"] == 1 and report["total"]["num_not_bitwise"] == 1
    assert report["truncation"] == {"num_truncated": 0, "max_abs": 0.0, "mean_abs": 0.0}
    assert report["kept_set_differs"]["count"] == 0
    empty = decompose_mismatch(logp[:0], logp[:0], logp[:0], torch.zeros(0, 2, dtype=torch.long), limit=1e-4)
    assert empty["max_abs"] is None and empty["num_tokens"] == 0


# --- matrices: the sampling fields and the sweep ------------------------------------------------------

MATRICES = Path(__file__).resolve().parents[3] / "matrices"


def with_rollout(tmp_path, **rollout):
    import yaml

    data = yaml.safe_load((MATRICES / "tiny-qwen3.yaml").read_text())
    data["rollout"].update(rollout)
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("rollout, message", [
    ({"min_p": -0.1}, "min_p must be in [0, 1), got -0.1"), ({"min_p": 1.0}, "min_p must be in [0, 1), got 1.0"),
    ({"min_p": math.nan}, "min_p must be a finite number"), ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_k": 0}, "top_k must be -1 (off) or >= 1, got 0"),
])
def test_sampling_fields_are_validated(tmp_path, rollout, message):
    from qualify.errors import MatrixError
    from qualify.matrix import load_matrix

    with pytest.raises(MatrixError, match=re.escape(message)):
        load_matrix(with_rollout(tmp_path, **rollout))


def test_truncated_sampling_loads_and_min_p_reaches_the_capture_request_only_when_set(tmp_path):
    from qualify.matrix import load_matrix
    from qualify.rollout.capture import capture_request, merge_requests, split_results

    m = load_matrix(with_rollout(tmp_path, top_k=50, top_p=0.9, min_p=0.05))
    assert (m.rollout.top_k, m.rollout.top_p, m.rollout.min_p) == (50, 0.9, 0.05)
    model = tmp_path / "actor"
    request = capture_request(m.capture, model, 1, vocab_size=512, eos_token_id=None)
    assert request["min_p"] == 0.05
    plain = capture_request(load_matrix(MATRICES / "tiny-qwen3.yaml").capture, model, 1, vocab_size=512, eos_token_id=None)
    assert "min_p" not in plain  # the committed rollouts' settings fingerprint does not change
    merged = merge_requests([plain, request])
    assert merged["prompts"] == plain["prompts"] + request["prompts"]
    assert merged["prompt_sampling"][0] == {"temperature": 0.8, "top_k": -1, "top_p": 1.0, "min_p": 0.0}
    assert merged["prompt_sampling"][-1] == {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.05}
    results = {"results": [{"i": i} for i in range(len(merged["prompts"]))]}
    first, second = split_results(results, [plain, request])
    assert len(first) == len(plain["prompts"]) and second[0] == {"i": len(plain["prompts"])}
    from qualify.errors import QualifyError

    with pytest.raises(QualifyError, match="requests differ in tp"):
        merge_requests([plain, plain | {"tp": 2}])


SWEEP_FILES = sorted((MATRICES / "tiny-qwen3-sweep").glob("*.yaml"))


def test_the_sweep_matrices_differ_only_in_sampling():
    import yaml

    from qualify.matrix import load_matrix

    assert len(SWEEP_FILES) >= 7
    docs = [yaml.safe_load(p.read_text()) for p in SWEEP_FILES]
    sampling = ("temperature", "top_k", "top_p", "min_p")
    for path, doc in zip(SWEEP_FILES, docs, strict=True):
        m = load_matrix(path)
        assert m.name == f"tiny-qwen3-sweep-{path.stem}" and m.rollout.vllm_tp == (1,)
        for key in sampling:
            doc["rollout"].pop(key)
        doc.pop("name"), doc.pop("description")
    assert all(doc == docs[0] for doc in docs)
    settings = {tuple(getattr(load_matrix(p).rollout, k) for k in sampling) for p in SWEEP_FILES}
    assert len(settings) == len(SWEEP_FILES)


def test_qwen3_8b_samples_as_a_real_run():
    from qualify.matrix import load_matrix

    assert load_matrix(MATRICES / "qwen3-8b.yaml").rollout.top_p < 1


def test_a_token_changed_after_sampling_is_refused_and_bf16_noise_or_an_edge_token_is_not(tmp_path):
    """A rollout imported with `reference --rollout`: a bf16 rollout's noise sits beyond the fp32 limit but within
    the bf16 one (kept), an edge token falls outside the kept set (kept, listed), a token changed after sampling
    (its recorded logprob is another token's) is beyond the limit of every precision: refused, naming it."""
    from qualify.errors import EvidenceError
    from qualify.reference.stage import require_sampled_tokens
    from qualify.reference.targets import decompose_mismatch, foreign_tokens

    gen = torch.Generator().manual_seed(0)
    fp32 = -torch.rand(64, generator=gen) * 3
    bf16 = fp32 + (torch.rand(64, generator=gen) - 0.5) * 0.02  # the reference's own bf16 scores
    sampler = fp32 + (torch.rand(64, generator=gen) - 0.5) * 0.02  # a bf16 rollout: as far from fp32 as bf16 is
    processed = fp32.clone()
    processed[7] = -INF  # an edge token under truncation
    where = torch.stack([torch.arange(64) // 8, torch.arange(64) % 8], 1)

    def report(sampler_N):
        return {p: decompose_mismatch(sampler_N, processed if p == "fp32" else torch.where(
                    torch.isinf(processed), processed, full), full, where,
                    1e-4 + 10 * float((full - fp32).abs().max()))
                for p, full in (("fp32", fp32), ("bf16", bf16))}

    honest = report(sampler)
    assert honest["fp32"]["kept_set_differs"]["count"] > 10  # the fp32 limit alone would refuse a bf16 rollout
    assert foreign_tokens(honest) == []
    require_sampled_tokens(honest, tmp_path)
    changed = sampler.clone()
    changed[42] = fp32[42] + 1.5  # the logprob of another token
    forged = report(changed)
    assert [(t["row"], t["position"]) for t in foreign_tokens(forged)] == [(5, 2)]
    with pytest.raises(EvidenceError, match=r"holds 1 token\(s\) .*\(row 5 position 2: sampler .*capture it again"):
        require_sampled_tokens(forged, tmp_path)
