"""qualify.judge.tiers: the invariance tier of each judged tensor (bitwise, within bound, failing) and the rows
of an engine that declares determinism: bitwise (bound 0, failing on any bit, NaN and signed zeros included)."""

from __future__ import annotations

import math

import torch

from qualify.compare import RunTensors
from qualify.judge.tiers import bitwise_rows, same_bits, tensor_tiers, tier_summary
from qualify.verdict import Row


def run(**outputs) -> RunTensors:
    return RunTensors(outputs=outputs, grads={}, updates={}, moments={})


def row(tensor: str, passed: bool = True) -> Row:
    return Row("c", "actor", "vs dp1 [fp32-repeat]", tensor, "max_abs", 0.0, 1.0, passed)


def test_same_bits_sees_signed_zeros_nan_payloads_shape_and_dtype():
    x = torch.tensor([0.0, 1.0])
    assert same_bits(x, x.clone()) and same_bits(torch.tensor([]), torch.tensor([]))
    assert same_bits(torch.tensor(2.0), torch.tensor(2.0)) and not same_bits(torch.tensor(0.0), torch.tensor(-0.0))
    assert not same_bits(x, torch.tensor([-0.0, 1.0]))
    assert same_bits(torch.tensor([math.nan]), torch.tensor([math.nan]))  # the same NaN bits
    assert not same_bits(x, x.double()) and not same_bits(x, x[:1]) and not same_bits(x, None)


def test_tiers_per_tensor():
    cand = [run(a=torch.tensor([1.0, 2.0]), b=torch.tensor([1.0, 2.0]), c=torch.tensor([3.0]))]
    base = [run(a=torch.tensor([1.0, 2.0]), b=torch.tensor([1.0, 2.5]), c=torch.tensor([4.0]))]
    rows = [row("step0/outputs/a"), row("step0/outputs/b"), row("step0/outputs/b"), row("step0/outputs/c", False)]
    tiers = tensor_tiers(rows, cand, base)
    assert tiers == {"step0/outputs/a": "bitwise", "step0/outputs/b": "within_bound", "step0/outputs/c": "failing"}
    assert tier_summary(tiers) == {"counts": {"bitwise": 1, "within_bound": 1, "failing": 1},
                                   "not_bitwise": {"step0/outputs/b": "within_bound", "step0/outputs/c": "failing"}}


def test_declared_bitwise_fails_on_any_difference():
    cand = [run(a=torch.tensor([1.0]), b=torch.tensor([0.0]), c=torch.tensor([1.0, 1.0]))]
    base = [run(a=torch.tensor([1.0]), b=torch.tensor([-0.0]), c=torch.tensor([1.0, 1.0 + 2**-20]))]
    rows = {r.tensor: r for r in bitwise_rows("c", "actor", "dp1", cand, base)}
    assert rows["step0/outputs/a"].passed and rows["step0/outputs/a"].bound == 0.0
    assert not rows["step0/outputs/b"].passed and rows["step0/outputs/b"].value == 0.0  # a signed zero
    assert not rows["step0/outputs/c"].passed and rows["step0/outputs/c"].value == 2**-20
    assert rows["step0/outputs/c"].comparison == "vs dp1 [bitwise]" and "determinism: bitwise" in rows["step0/outputs/c"].rule
    missing = bitwise_rows("c", "actor", "tp1", [run(a=torch.tensor([1.0]))], [run()])
    assert [(r.value, r.passed) for r in missing] == [(math.inf, False)]


def test_the_terminal_verdict_shows_each_cases_tiers():
    from rich.console import Console

    from qualify.cli.verdict_view import _cases_footer

    tiers = {"counts": {"bitwise": 3, "failing": 1, "within_bound": 5}, "not_bitwise": {}}
    verdict = {"passed": False, "cases": {
        "e-fp32-tp1-actor": {"passed": True, "num_checks": 9, "num_failed": 0},
        "e-fp32-tp1-dp2-actor": {"passed": False, "num_checks": 9, "num_failed": 1, "invariance": {"vs dp1": tiers}}}}
    console = Console(record=True, width=200)
    _cases_footer(verdict, console)
    text = console.export_text()
    assert "e-fp32-tp1-actor: 9 checks, 0 failed\n" in text
    assert "e-fp32-tp1-dp2-actor: 9 checks, 1 failed; vs dp1: 3 bitwise, 5 within bound, 1 failing" in text
