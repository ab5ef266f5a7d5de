"""candidates.logprob_formula: the matrix field, the formula's logprobs, what an engine reports,
and the reference runs and bounds seen through the declared formula when a case is judged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qualify.candidate.worker import report_logprobs
from qualify.compare import RunTensors
from qualify.engines.base import Batch, EngineContext
from qualify.errors import EvidenceError
from qualify.judge.formula import (
    declared_formula,
    explain_formula,
    formula_bounds,
    formula_run,
    formula_steps,
)
from qualify.judge.steps import judge_steps
from qualify.matrix import load_matrix
from qualify.models.hf import declared_logprobs, logprobs_from_outputs
from qualify.ppo.formula import PROCESSED_KEY, Sampling, formula_logprobs
from qualify.ppo.logprob import processed_logprobs, sampler_logprobs
from tests.unit._runs import OPT
from tests.unit.matrix.test_loader import MATRICES, edited, load_error, setter, write

B, T, V = 3, 9, 40
TOP_P = Sampling(temperature=0.7, top_p=0.6)


def logits_and_tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)


# --- the matrix field ---------------------------------------------------------------------------------------------

def test_default_is_full_and_processed_loads(tmp_path):
    assert load_matrix(MATRICES / "tiny-qwen3.yaml").candidates.logprob_formula == "full"
    path = write(tmp_path, edited(setter("candidates.logprob_formula", "processed")))
    assert load_matrix(path).candidates.logprob_formula == "processed"


@pytest.mark.parametrize("value", ["sampler", "Processed", 1, None, ["full"]])
def test_bad_formula_is_a_one_line_error_naming_key_and_choices(tmp_path, value):
    message = load_error(tmp_path, edited(setter("candidates.logprob_formula", value)))
    assert "candidates.logprob_formula" in message and "'full' | 'processed'" in message, message
    assert "\n" not in message


# --- the formula's logprobs -----------------------------------------------------------------------------------------

def test_full_is_bitwise_the_sampler_formula():
    logits, tokens = logits_and_tokens()
    got = formula_logprobs(logits, tokens, "full", TOP_P, 5, V)
    assert torch.equal(got, sampler_logprobs(logits, tokens, TOP_P.temperature, 5, V))


def test_processed_is_vllms_on_the_kept_set_and_finite_outside_it():
    logits, tokens = logits_and_tokens(1)
    got = formula_logprobs(logits, tokens, "processed", TOP_P, 5, V)
    ev = processed_logprobs(logits, tokens, temperature=0.7, top_p=0.6, chunk_tokens=5, vocab_size=V)
    kept = torch.isfinite(ev.processed)
    assert kept.any() and (~kept).any()  # random tokens: some in the top-p set, some outside it
    assert torch.equal(got[kept], ev.processed[kept])
    assert torch.isfinite(got).all()
    assert torch.equal(got[~kept], (ev.full - ev.log_kept_mass)[~kept])
    assert (got[~kept] > ev.full[~kept]).all()  # renormalized by a kept mass below 1


def test_processed_without_truncation_is_bitwise_full():
    logits, tokens = logits_and_tokens(2)
    off = Sampling(temperature=0.8, top_k=V, top_p=1.0)
    assert not off.truncates(V) and TOP_P.truncates(V) and Sampling(1.0, top_k=3).truncates(V)
    assert torch.equal(formula_logprobs(logits, tokens, "processed", off, 4, V),
                       formula_logprobs(logits, tokens, "full", off, 4, V))


def test_logprobs_from_outputs_score_token_t_from_position_t_minus_1():
    logits, ids = logits_and_tokens(3)
    got = logprobs_from_outputs(logits, ids, "processed", TOP_P, 8, V)
    assert torch.equal(got[:, 0], torch.zeros(B))
    assert torch.equal(got[:, 1:], formula_logprobs(logits[:, :-1], ids[:, 1:], "processed", TOP_P, 8, V))


def context(role: str, formula: str) -> EngineContext:
    return EngineContext(role=role, precision="fp32", tp=1, rank=0, device="cpu", model_dir=Path("."), optimizer=OPT,
                         temperature=0.7, logprob_chunk_tokens=8, vocab_size=V, work_dir=Path("."),
                         logprob_formula=formula, top_p=0.6)


def test_engines_report_only_what_score_does_not_give():
    logits, ids = logits_and_tokens(4)
    assert context("actor", "processed").sampling() == TOP_P
    assert declared_logprobs(context("actor", "full"), logits, ids) is None  # score() is the full formula
    assert declared_logprobs(context("critic", "processed"), logits, ids) is None
    assert torch.equal(declared_logprobs(context("actor", "processed"), logits, ids),
                       logprobs_from_outputs(logits, ids, "processed", TOP_P, 8, V))


class Hook:
    def __init__(self, logprobs_BT):
        self.value = logprobs_BT

    def logprobs(self):
        return self.value


def test_the_worker_judges_the_hooks_logprobs_on_response_tokens_only():
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 4:] = True
    batch = Batch(input_ids_BT=torch.zeros(B, T, dtype=torch.long), response_mask_BT=mask)
    full = torch.full((B, T), -2.0) * mask
    for engine in (object(), Hook(None)):  # no hook, or a hook that defers to score(): unchanged
        outputs = {"logprobs_BT": full.clone()}
        report_logprobs(engine, outputs, batch)
        assert torch.equal(outputs["logprobs_BT"], full)
    outputs = {"logprobs_BT": full.clone()}
    report_logprobs(Hook(torch.full((B, T), -1.0, dtype=torch.float64)), outputs, batch)
    assert torch.equal(outputs["logprobs_BT"], torch.where(mask, -1.0, 0.0).float())
    critic = {"values_BT": full.clone()}
    report_logprobs(Hook(torch.ones(B, T)), critic, batch)
    assert set(critic) == {"values_BT"}


# --- the reference seen through the declared formula ----------------------------------------------------------------

def run(full: float, processed: float | None) -> RunTensors:
    outputs = {"logprobs_BT": torch.full((2, 3), full), "loss": torch.tensor(0.5)}
    if processed is not None:
        outputs[PROCESSED_KEY] = torch.full((2, 3), processed)
    return RunTensors(outputs=outputs, grads={}, updates={}, moments={})


def bounds_of(*steps: int, processed: bool = True) -> dict:
    out = {}
    for k in steps:
        out[f"step{k}/outputs/logprobs_BT"] = {"max_abs": {"bound": 1e-6}}
        out[f"step{k}/outputs/loss"] = {"max_abs": {"bound": 1e-6}}
        if processed:
            out[f"step{k}/outputs/{PROCESSED_KEY}"] = {"max_abs": {"bound": 3e-6}}
    return out


def test_full_drops_the_processed_tensor_and_bound():
    ref = formula_run(run(-2.0, -1.9), "full", truncates=True)
    assert set(ref.outputs) == {"logprobs_BT", "loss"} and float(ref.outputs["logprobs_BT"][0, 0]) == -2.0
    assert formula_bounds(bounds_of(0, 1), "full", truncates=True) == bounds_of(0, 1, processed=False)


def test_processed_judges_against_the_processed_tensor_and_bound():
    ref = formula_steps([run(-2.0, -1.9), run(-2.1, -2.0)], "processed", truncates=True)
    assert [set(r.outputs) for r in ref] == [{"logprobs_BT", "loss"}] * 2
    assert [float(r.outputs["logprobs_BT"][0, 0]) for r in ref] == pytest.approx([-1.9, -2.0])
    got = formula_bounds(bounds_of(0, 1), "processed", truncates=True)
    assert set(got) == set(bounds_of(0, 1, processed=False))
    assert got["step1/outputs/logprobs_BT"]["max_abs"]["bound"] == 3e-6 and got["step1/outputs/loss"]["max_abs"][
        "bound"] == 1e-6


def test_an_acceptance_without_processed_tensors():
    old, old_bounds = run(-2.0, None), bounds_of(0, processed=False)
    for formula, truncates in (("full", True), ("full", False), ("processed", False)):  # the full one stands for both
        assert formula_run(old, formula, truncates).outputs.keys() == old.outputs.keys()
        assert formula_bounds(old_bounds, formula, truncates) == old_bounds
    with pytest.raises(EvidenceError, match="predate"):
        formula_run(old, "processed", truncates=True)
    with pytest.raises(EvidenceError, match="predate"):
        formula_bounds(old_bounds, "processed", truncates=True)


def test_a_critic_run_is_untouched():
    critic = RunTensors(outputs={"values_BT": torch.zeros(2, 3)}, grads={}, updates={}, moments={})
    assert formula_run(critic, "processed", truncates=True).outputs.keys() == {"values_BT"}


def test_declared_formula_from_the_sealed_spec():
    spec = {"name": "c", "logprob_formula": "processed", "temperature": 1.0, "top_k": -1, "top_p": 0.9,
            "min_p": 0.0, "vocab_size": 512}
    assert declared_formula({"case": spec}) == ("processed", True)
    assert declared_formula({"case": spec | {"top_p": 1.0}}) == ("processed", False)
    assert declared_formula({"case": {"name": "old", "temperature": 0.8, "vocab_size": 512}}) == ("full", False)
    with pytest.raises(EvidenceError, match="'sampled'"):
        declared_formula({"case": spec | {"logprob_formula": "sampled"}})


def test_a_formula_mismatch_fails_on_logprobs_and_says_so():
    reference = [run(-2.0, -1.9)]
    bounds = bounds_of(0)
    for declared, computed in (("processed", -2.0), ("full", -1.9)):
        candidate = [run(computed, None)]
        rows = judge_steps("c", "actor", "vs ref", candidate, formula_steps(reference, declared, True),
                           formula_bounds(bounds, declared, True), [{}], OPT)
        rows = explain_formula(rows, candidate, reference, bounds, declared)
        bad = [r for r in rows if not r.passed]
        assert [(r.tensor, r.metric) for r in bad] == [("step0/outputs/logprobs_BT", "max_abs")], bad
        assert bad[0].value == pytest.approx(0.1, rel=1e-5)
        assert f"judged against the reference's {declared}-formula logprobs" in bad[0].note
        assert "(formula mismatch)" in bad[0].note, bad[0].note
    right = [run(-1.9, None)]
    rows = judge_steps("c", "actor", "vs ref", right, formula_steps(reference, "processed", True),
                       formula_bounds(bounds, "processed", True), [{}], OPT)
    assert all(r.passed for r in explain_formula(rows, right, reference, bounds, "processed"))
