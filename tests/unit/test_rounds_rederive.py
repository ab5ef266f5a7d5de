"""A rounds row's outcome decided again from its value and written rule, and a probe's from its record: each rule
form a rounds run writes, with a value that meets it and one that does not; an unreadable rule is never a pass."""

from __future__ import annotations

import json

import pytest

from qualify.rounds.checks import agreement_row, cold_row, equal_row, same_tokens_row, sensitivity_row, warm_row
from qualify.rounds.rederive import probe_outcome, rederive_problems, rule_outcome


def row(r) -> dict:
    return json.loads(json.dumps(r.to_json()))  # as a verdict file holds it


STATS = {"num_tokens": 4, "num_not_bitwise": 1, "max_abs": 2e-6, "mean_abs": 1e-6}


@pytest.mark.parametrize("made", [
    agreement_row("logprobs agree with HF", 0, STATS, 1e-5, 0),
    agreement_row("logprobs agree with HF", 0, STATS | {"max_abs": 3e-5}, 1e-5, 0),
    sensitivity_row(1, STATS | {"max_abs": 0.5}, 1e-5, 1, 0),
    sensitivity_row(1, STATS, 1e-5, 1, 0),
    cold_row("fresh engine: nothing cached", 0, [0, 0], ""),
    cold_row("fresh engine: nothing cached", 0, [0, 16], ""),
    warm_row("replay warm", 0, [32, 32], 16, ""),
    warm_row("replay warm", 0, [32, 8], 16, ""),
    warm_row("replay warm", 0, [], 16, ""),
    same_tokens_row("same", 0, [{"tokens": [1]}, {"tokens": [2]}], [{"tokens": [1]}, {"tokens": [2]}]),
    same_tokens_row("same", 0, [{"tokens": [1]}, {"tokens": [2]}], [{"tokens": [1]}, {"tokens": [3]}]),
    equal_row("acks", 1, [[0, 1], [1, 1]], [[0, 1], [1, 1]]),
    equal_row("acks", 1, [[0, 1], [1, 0]], [[0, 1], [1, 1]]),
    equal_row("digest unchanged", None, "sha256:ab", "sha256:ab"),
    equal_row("digest unchanged", None, "sha256:ab", "sha256:cd"),
    equal_row("no /dev/shm segment left behind", None, [], []),
    equal_row("no /dev/shm segment left behind", None, ["qualify-x"], []),
])
def test_every_rule_form_is_judged_again_as_the_run_judged_it(made):
    assert rule_outcome(row(made)) is made.passed


def test_a_flipped_outcome_or_unknown_rule_is_a_problem(tmp_path):
    good = row(cold_row("fresh engine: nothing cached", 0, [0, 16], ""))
    doc = {"rounds": 1, "passed": True, "rows": [good | {"passed": True}]}
    assert "passed=True does not follow from [0, 16]" in rederive_problems(tmp_path, doc, None)[0]
    odd = good | {"rule": "looks fine to me", "passed": True}
    assert "cannot be judged again" in rederive_problems(tmp_path, doc | {"rows": [odd]}, None)[0]
    assert rule_outcome(good | {"rule": None}) is None


def test_a_bound_other_than_the_frozen_one_is_a_problem(tmp_path):
    widened = row(agreement_row("logprobs agree with HF", 0, STATS | {"max_abs": 3e-5}, 1e-3, 0))
    problems = rederive_problems(tmp_path, {"rounds": 0, "passed": True, "rows": [widened]}, 1e-5)
    assert any("bound 0.001 is not the frozen 1e-05" in p for p in problems), problems


def test_a_passing_verdict_without_its_rounds_evidence_is_a_problem(tmp_path):
    ok = row(equal_row("no /dev/shm segment left behind", None, [], []))
    problems = rederive_problems(tmp_path, {"rounds": 2, "passed": True, "rows": [ok]}, None)
    assert "round-0, round-1, install after round 0 is not there" in problems[0]


FAULT = {"required": "install_failed naming 'rank 0: no acknowledgment', then generate and install refused",
         "observed": "install_failed", "problems": ["rank 0: no acknowledgment"],
         "after": {"generate": "unusable", "install": "unusable"}}
STALE = {"observed": "stale_version", "reply": {"ok": False}, "state_after": {"state": "ready", "version": 0}}
WARM = {"guard": {"kind": "warm_cache"}, "first_cached_tokens": [32, 32], "agreement_check": {"value": 0.3},
        "after": {"generate": "unusable"}}


@pytest.mark.parametrize(("name", "record", "broken"), [
    ("missing-ack", FAULT, {"observed": None}),
    ("missing-ack", FAULT, {"problems": ["rank 1: something else"]}),
    ("missing-ack", FAULT, {"after": {"generate": None, "install": "unusable"}}),
    ("stale-reinstall-v0", STALE, {"state_after": {"state": "ready", "version": 1}}),
    ("stale-skip-to-v2", STALE, {"reply": {"ok": True}}),
    ("warm-cache", WARM, {"first_cached_tokens": [0, 0]}),
    ("warm-cache", WARM, {"agreement_check": {"value": 1e-6}}),
    ("warm-cache", WARM, {"guard": None}),
])
def test_each_probe_is_decided_again_from_its_record(name, record, broken):
    assert probe_outcome(name, record, 1e-5) is True
    assert probe_outcome(name, record | broken, 1e-5) is False
