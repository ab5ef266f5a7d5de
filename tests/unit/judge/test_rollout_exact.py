"""qualify.judge.rollout_exact: a case's step-0 logprobs against the rollout's, bit for bit, on response tokens.

A declared case in the rollout's precision passes only when every response token is bitwise the rollout's; one ulp on
one token fails it, naming the count and the first token; tokens outside the response mask do not count; a non-finite
score counts; an undeclared engine and another precision are reported with an infinite bound; a critic has no row;
the matrix refuses a declaration for an engine it does not run; the spec records the claim only when it is made."""

from __future__ import annotations

import math

import pytest
import torch

from qualify.case.spec import make_spec
from qualify.judge.rollout_exact import DECLARED_RULE, REPORTED_RULE, exact_rows, mismatch
from qualify.matrix import Case, load_matrix
from tests.conftest import TINY


def rollout(seed=0):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(3, 6, generator=g) * 5
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[:, 2:] = True
    mask[2, 5] = False  # an early end
    return logprobs, mask


def meta(declared=True, precision="fp32", dtype="fp32"):
    case = {"precision": precision, "logprob_formula": "full"}
    if declared:
        case |= {"rollout_exact": True, "rollout_dtype": dtype}
    return {"case": case}


def row(own, declared=True, precision="fp32", dtype="fp32", role="actor"):
    old, mask = rollout()
    rows = exact_rows("c", role, {"logprobs_BT": own}, meta(declared, precision, dtype), old, mask)
    return rows[0] if rows else None


def test_bitwise_equal_response_tokens_pass_a_declared_case():
    old, _ = rollout()
    r = row(old.clone())
    assert r.passed and r.value == 0 and r.bound == 0 and r.rule == DECLARED_RULE
    assert r.note.startswith("exact: 0 of 11 response tokens differ")


def test_one_ulp_on_one_token_fails_naming_it():
    own, _ = rollout()
    own = own.clone()
    own[1, 3] = torch.nextafter(own[1, 3], torch.tensor(0.0))
    r = row(own)
    assert not r.passed and r.value == 1 and r.bound == 0
    assert "1 of 11 response tokens differ" in r.note and "first at row 1 position 3" in r.note
    assert r.comparison == "rollout" and r.tensor == "step0/outputs/logprobs_BT" and r.step == 0


def test_tokens_outside_the_response_do_not_count_and_a_nan_does():
    own, mask = rollout()
    own = own.clone()
    own[~mask] = 123.0
    assert row(own).passed
    own[0, 4] = math.nan
    r = row(own)
    assert not r.passed and r.value == 1
    assert mismatch(own, rollout()[0], mask)["max_abs"] == 0.0  # the NaN is counted, not measured


def test_undeclared_and_other_precision_cases_are_reported_not_judged():
    own, _ = rollout(seed=1)  # every token differs
    undeclared = row(own, declared=False)
    assert undeclared.passed and undeclared.bound == math.inf and undeclared.rule == REPORTED_RULE
    assert undeclared.value == 11
    other = row(own, precision="bf16", dtype="fp32")
    assert other.passed and other.bound == math.inf and "rollout's precision, fp32" in other.rule
    assert not row(own).passed  # the same tokens fail the declared case in the rollout's precision


def test_a_critic_has_no_row_and_missing_logprobs_fail_a_declared_case():
    assert row(torch.zeros(3, 6), role="critic") is None
    old, mask = rollout()
    [r] = exact_rows("c", "actor", {}, meta(), old, mask)
    assert not r.passed and r.value == math.inf and "no step-0 logprobs" in r.note


def test_the_matrix_and_the_spec_carry_the_claim(tmp_path):
    import yaml

    data = yaml.safe_load(TINY.read_text())
    data["candidates"]["rollout_exact"] = ["megatron"]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match="rollout_exact names \\['megatron'\\]"):
        load_matrix(tmp_path / "bad.yaml")
    data["candidates"]["rollout_exact"] = ["torch-tp"]
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(data))
    m = load_matrix(tmp_path / "ok.yaml")
    kw = {"model_dir": tmp_path, "rollout_dir": tmp_path, "targets_dir": tmp_path, "rollout_digest": "r",
          "targets_digest": "t", "case_dir": tmp_path / "c", "vocab_size": 128, "device": "cpu"}
    declared = make_spec(m.case_settings, Case(engine="torch-tp", precision="fp32", tp=1, role="actor"), **kw).to_json()
    assert declared["rollout_exact"] is True and declared["rollout_dtype"] == m.rollout.dtype
    other = make_spec(m.case_settings, Case(engine="deepspeed", precision="fp32", tp=1, role="actor"), **kw).to_json()
    assert "rollout_exact" not in other and "rollout_dtype" not in other  # an undeclared spec reads as before
