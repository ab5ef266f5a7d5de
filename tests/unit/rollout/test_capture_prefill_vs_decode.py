"""The rollout engine against itself: qualify.rollout.capture.prefill_vs_decode counts the sampled
tokens whose decode logprob differs from the one vLLM's prefill of the same sequence gives, over the prompts sampled
at T = 1 without truncation (qualify.rollout.vllm_worker.prefill_comparable); the exact tier's row cites it
(qualify.judge.rollout_exact.engine_self_note). vLLM itself runs in tests/integration/test_sampling.py."""

from __future__ import annotations

import math

import pytest
import torch

from qualify.judge.rollout_exact import engine_self_note, exact_rows
from qualify.rollout.capture import prefill_vs_decode
from qualify.rollout.vllm_worker import prefill_comparable


def result(prompt_len, decode, prefill=None):
    r = {"prompt": list(range(prompt_len)), "tokens": list(range(len(decode))), "logprobs": decode}
    return r if prefill is None else r | {"prefill_logprobs": prefill}


def test_an_engine_that_agrees_with_itself_has_no_token_apart():
    record = prefill_vs_decode([result(3, [-1.5, -0.25]), result(2, [-2.0], [-2.0]), result(4, [-0.5, -3.0],
                                                                                           [-0.5, -3.0])])
    assert record == {"num_rows": 2, "num_tokens": 3, "num_not_bitwise": 0, "max_abs": 0.0, "tokens": []}
    assert "reproduces its decode (0 of 3 tokens differ)" in engine_self_note(record)


def test_one_ulp_apart_is_counted_at_its_row_and_position():
    near = float(torch.nextafter(torch.tensor(-2.0), torch.tensor(0.0)))
    record = prefill_vs_decode([result(2, [-1.0], [-1.0]), result(5, [-3.0, -2.0], [-3.0, near])])
    assert record["num_not_bitwise"] == 1 and record["num_tokens"] == 3
    assert record["tokens"] == [{"row": 1, "position": 6, "decode": -2.0, "prefill": near}]
    assert record["max_abs"] == pytest.approx(abs(near + 2.0))
    note = engine_self_note(record)
    assert "own prefill differs from its decode on 1 of 3 tokens" in note and "row 1 position 6" in note
    assert "only a replay of its decode steps" in note


def test_an_infinite_logprob_differs_without_poisoning_the_max():
    record = prefill_vs_decode([result(1, [-math.inf, -1.0], [-50.0, -1.0])])
    assert record["num_not_bitwise"] == 1 and record["max_abs"] == 0.0


@pytest.mark.parametrize(("results", "error", "routed", "says"), [
    ([result(2, [-1.0])], None, False, "no prompt sampled at T = 1 without truncation"),
    ([result(2, [-1.0])], "RuntimeError: boom", False, "the prefill pass failed: RuntimeError: boom"),
    ([result(2, [-1.0])], None, True, "a routed capture (MoE) is not fed again"),
])
def test_a_check_not_made_says_why(results, error, routed, says):
    record = prefill_vs_decode(results, error, routed)
    assert record == {"skipped": record["skipped"]} and says in record["skipped"]
    assert "not measured" in engine_self_note(record) and says in engine_self_note(record)


def test_a_rollout_from_before_the_check_adds_nothing():
    assert engine_self_note(None) == ""


@pytest.mark.parametrize(("sampling", "comparable"), [
    ({"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0}, True),
    ({"temperature": 1.0, "top_k": 0, "top_p": 1.0}, True),
    ({"temperature": 0.8, "top_k": -1, "top_p": 1.0, "min_p": 0.0}, False),  # prompt logprobs skip the temperature
    ({"temperature": 1.0, "top_k": 20, "top_p": 1.0, "min_p": 0.0}, False),
    ({"temperature": 1.0, "top_k": -1, "top_p": 0.9, "min_p": 0.0}, False),
    ({"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.05}, False),
])
def test_only_the_decode_formula_vllms_prompt_logprobs_compute_is_compared(sampling, comparable):
    assert prefill_comparable(sampling) is comparable


def test_the_exact_row_cites_the_engine_against_itself():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 4, generator=g)
    mask = torch.ones(2, 4, dtype=torch.bool)
    spec = {"case": {"precision": "bf16", "logprob_formula": "full", "rollout_exact": True, "rollout_dtype": "bf16"}}
    record = prefill_vs_decode([result(1, [-1.0, -2.0], [-1.0, -2.5])])
    [row] = exact_rows("c", "actor", {"logprobs_BT": old + 1e-3}, spec, old, mask, record)
    assert not row.passed and row.note.startswith("not exact: 8 of 8")
    assert engine_self_note(record) in row.note and "differs from its decode on 1 of 2 tokens" in row.note
    # then what the layers say (qualify.judge.layer_probe): here the case's meta holds no layer probe
    assert row.note.endswith(engine_self_note(record) + "; layers: not compared (the case's evidence holds no layer "
                             "probe)")


def test_the_report_shows_the_engine_against_itself():
    from qualify.report import rollout_self_line
    from qualify.report_html.page import rollout_section

    measured = prefill_vs_decode([result(1, [-1.0, -2.0], [-1.0, -2.5])])
    assert rollout_self_line(measured).startswith("vLLM's prefill vs its own decode: 1 of 2 sampled tokens differ")
    skipped = prefill_vs_decode([result(1, [-1.0])])
    assert "not measured (no prompt sampled at T = 1" in rollout_self_line(skipped)
    page = rollout_section({"rollout_mismatch": {}, "tp_agreement": {}, "rollout_self": measured}, None)
    assert "1 of 2 sampled tokens differ" in page
    assert "prefill" not in rollout_section({"rollout_mismatch": {}, "tp_agreement": {}}, None)  # before the check
