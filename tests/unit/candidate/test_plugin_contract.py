"""The engine plugin contract's checks (qualify.candidate.plugin_contract): what the harness's own objective gives
passes; each mistake a plugin author makes is one line naming the plugin, the hook, what was expected and what came
back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qualify.candidate.plugin_contract import (
    ContractError,
    check_grads,
    check_loss,
    check_objective_signature,
    check_outputs,
)
from qualify.ppo.objective import role_objective

PPO = SimpleNamespace(clip_eps=0.2, value_clip_eps=0.2, token_normalizer="global", normalizer_constant=None)
MASK = torch.tensor([[False, True, True, False], [False, False, True, True]])


def reference(role: str):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 4, generator=gen, requires_grad=True)
    targets = {k: torch.randn(2, 4, generator=gen) for k in ("old_logprobs_BT", "advantages_BT", "ref_logprobs_BT",
                                                              "old_values_BT", "returns_BT")}
    return role_objective(role, PPO, scores, MASK, targets)


def one_line(exc: pytest.ExceptionInfo, *parts: str) -> None:
    text = str(exc.value)
    assert "\n" not in text and text.startswith("engine plug:"), text
    for part in parts:
        assert part in text, text


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_the_harness_objective_meets_the_contract(role):
    loss, outputs = reference(role)
    check_loss("plug", loss)
    check_outputs("plug", outputs, outputs, MASK)
    check_grads("plug", {"w": torch.zeros(2)}, {"w": "float32", "unused": "float32"})


def test_a_loss_per_row_or_detached_is_refused():
    loss, _ = reference("actor")
    with pytest.raises(ContractError) as exc:
        check_loss("plug", loss.expand(2))
    one_line(exc, "objective() returned as loss a tensor of shape (2,)", "expected one floating number")
    with pytest.raises(ContractError) as exc:
        check_loss("plug", loss.detach())
    one_line(exc, "does not require grad")
    with pytest.raises(ContractError) as exc:
        check_loss("plug", 0.5)
    one_line(exc, "as loss a float")


def test_outputs_missing_misshapen_or_not_zero_off_the_mask_are_refused():
    _, outputs = reference("actor")
    with pytest.raises(ContractError) as exc:
        check_outputs("plug", {k: v for k, v in outputs.items() if k != "kl_BT"}, outputs, MASK)
    one_line(exc, "objective()'s outputs lack kl_BT", "the role's outputs are clip_frac, kl_BT, kl_mean")
    with pytest.raises(ContractError) as exc:
        check_outputs("plug", outputs | {"ratio_BT": outputs["ratio_BT"][:, 1:]}, outputs, MASK)
    one_line(exc, "output ratio_BT is a tensor of shape (2, 3) (float32); expected a floating tensor of shape (2, 4)")
    with pytest.raises(ContractError) as exc:
        check_outputs("plug", outputs | {"logprobs_BT": outputs["logprobs_BT"] + 1.0}, outputs, MASK)
    one_line(exc, "output logprobs_BT is not 0 off the response mask (4 prompt or padding positions")
    with pytest.raises(ContractError) as exc:
        check_outputs("plug", outputs | {"kl_mean": outputs["kl_mean"].long()}, outputs, MASK)
    one_line(exc, "output kl_mean is a tensor of shape () (int64)")
    with pytest.raises(ContractError) as exc:
        check_outputs("plug", [outputs], outputs, MASK)
    one_line(exc, "returned as outputs a list")


def test_grads_and_their_dtypes_must_name_the_same_parameters():
    with pytest.raises(ContractError) as exc:
        check_grads("plug", {"w": torch.zeros(2)}, None)
    one_line(exc, "grad_dtypes() returned a NoneType", "for each of the 1 parameters")
    with pytest.raises(ContractError) as exc:
        check_grads("plug", {"w": torch.zeros(2)}, {"v": "float32"})
    one_line(exc, "grad_dtypes() returned 1 names")
    with pytest.raises(ContractError) as exc:
        check_grads("plug", [torch.zeros(2)], {})
    one_line(exc, "grads() returned a list")


def test_a_ppo_objective_signature_under_grpo_is_refused_before_setup():
    class Five:
        def objective(self, role, ppo, scores_BT, response_mask_BT, targets):
            return None

    class Kw:
        def objective(self, role, ppo, scores_BT, response_mask_BT, targets, **kw):
            return None

    with pytest.raises(ContractError) as exc:
        check_objective_signature(Five(), "plug", grpo=True)
    one_line(exc, "objective(role, ppo, scores_BT, response_mask_BT, targets) cannot take grpo= and share=")
    assert check_objective_signature(Kw(), "plug", grpo=True) is True


def test_a_ppo_objective_without_share_runs_at_dp1_and_is_refused_above():
    """PPO: an objective() that cannot take share= is called without it at DP1 (its rows are the whole step), and
    refused at DP > 1, where only the step's normalizers over every DP rank make its loss the rank's share."""
    class Five:
        def objective(self, role, ppo, scores_BT, response_mask_BT, targets):
            return None

    class Shared:
        def objective(self, role, ppo, scores_BT, response_mask_BT, targets, *, share=None):
            return None

    assert check_objective_signature(Five(), "plug", grpo=False) is False
    assert check_objective_signature(Five(), "plug", grpo=False, dp=1) is False
    with pytest.raises(ContractError) as exc:
        check_objective_signature(Five(), "plug", grpo=False, dp=2)
    one_line(exc, "engine plug: objective(role, ppo, scores_BT, response_mask_BT, targets) cannot take share=; "
                  "under PPO at DP 2")
    assert check_objective_signature(Shared(), "plug", grpo=False, dp=1) is True
    assert check_objective_signature(Shared(), "plug", grpo=False, dp=2) is True
    assert check_objective_signature(object(), "plug", grpo=False, dp=2) is False  # no hook: the harness's own
