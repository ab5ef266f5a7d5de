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
    doc = {"rounds": 2, "passed": False, "rows": [good | {"passed": True}]}
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
    assert any("round-0, round-1, install after round 0 is not there" in p for p in problems), problems


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


def crashed_in_round_zero(where) -> None:
    """The evidence a rounds run leaves when its trainer crashed in round 0: round 0 rolled out and checked, its
    training step started (a partial train/ directory), no install, no round 1."""
    from qualify.store import write_json

    (where / "round-0" / "train").mkdir(parents=True)
    write_json(where / "round-0" / "round.json", {"version": 0})


def forged_pass(rounds: int) -> dict:
    """Its verdict edited into a pass: the 'rounds completed' row and the failure dropped, the count lowered."""
    ok = row(equal_row("no /dev/shm segment left behind", None, [], []))
    return {"rounds": rounds, "passed": True, "failure": None, "rows": [ok],
            "actor_versions": [{"version": 0, "digest": "sha256:v0"}]}


@pytest.mark.parametrize("rounds", [0, 1])
def test_a_crashed_run_that_claims_fewer_rounds_is_a_problem(tmp_path, rounds):
    """Issue 53: a rounds run whose training crashed in round 0, its verdict edited to passed with `rounds: 1` (or 0)
    and its 'rounds completed' row dropped, is not what its evidence gives: a rounds run has at least 2 rounds, the
    frozen matrix asked for 2, and round 0 trained (only a round with a round after it does)."""
    crashed_in_round_zero(tmp_path)
    problems = " ".join(rederive_problems(tmp_path, forged_pass(rounds), None, asked=2))
    assert f"claims {rounds} rounds; a rounds run has at least 2" in problems
    assert f"claims {rounds} rounds; 2 were asked for" in problems
    if rounds == 1:
        assert "round 0 trained an actor step: the run asked for more than its 1 rounds" in problems


def test_a_pass_that_claims_fewer_rounds_than_asked_is_a_problem(tmp_path):
    """A run of 2 rounds forged out of a 3-round run that crashed in round 1's training: round 1 trained, and the
    count is below what was asked."""
    from qualify.store import write_json

    for rnd in (0, 1):
        (tmp_path / f"round-{rnd}" / "train").mkdir(parents=True)
        write_json(tmp_path / f"round-{rnd}" / "round.json", {"version": rnd})
    write_json(tmp_path / "round-0" / "install.json", {"version_digest": "sha256:v1"})
    doc = forged_pass(2) | {"actor_versions": [{"version": 0, "digest": "sha256:v0"},
                                               {"version": 1, "digest": "sha256:v1"}]}
    problems = " ".join(rederive_problems(tmp_path, doc, None, asked=3))
    assert "claims 2 rounds; 3 were asked for" in problems
    assert "round 1 trained an actor step: the run asked for more than its 2 rounds" in problems


def test_a_pass_needs_one_installed_actor_version_per_round(tmp_path):
    """A passing verdict's actor versions are v0 .. v(rounds-1), each v(r+1) the one round r's install acknowledged;
    evidence of a round past the count is a problem."""
    from qualify.store import write_json

    for rnd in (0, 1):
        (tmp_path / f"round-{rnd}").mkdir()
        write_json(tmp_path / f"round-{rnd}" / "round.json", {"version": rnd})
    (tmp_path / "round-0" / "train").mkdir()
    write_json(tmp_path / "round-0" / "install.json", {"version_digest": "sha256:v1"})
    good = forged_pass(2) | {"actor_versions": [{"version": 0, "digest": "sha256:v0"},
                                                {"version": 1, "digest": "sha256:v1"}]}

    def count_problems(doc: dict) -> list[str]:
        return [p for p in rederive_problems(tmp_path, doc, None, asked=2)
                if "actor version" in p or "rounds" in p or "round-" in p]
    assert count_problems(good) == []
    assert "its actor versions are [0] for 2 rounds" in " ".join(count_problems(good | {"actor_versions": [
        {"version": 0, "digest": "sha256:v0"}]}))
    other = good | {"actor_versions": [{"version": 0, "digest": "sha256:v0"}, {"version": 1, "digest": "sha256:x"}]}
    assert "actor version 1 is sha256:x; the install after round 0 acknowledged sha256:v1" in \
        " ".join(count_problems(other))
    (tmp_path / "round-2").mkdir()
    assert "round-2 is in the evidence beyond the 2 rounds it claims" in " ".join(count_problems(good))
