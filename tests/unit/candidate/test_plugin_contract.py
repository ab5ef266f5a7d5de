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
from qualify.errors import EngineError
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


ENGINE = "".join(f"    def {m}(self, *args):\n        return None\n\n" for m in
                 ("setup", "score", "backward", "grads", "grad_dtypes", "step", "params", "optimizer_state",
                  "replicated", "padded_rows", "close"))
"""The body of a class with every TrainEngine method and no hook."""
FIVE = "    def objective(self, role, ppo, scores_BT, response_mask_BT, targets):\n        return None\n\n"
"""A PPO objective() that takes neither grpo= nor share=."""


def static_objective(grpo: bool = False, entropy_coef: float = 0.0):
    """The tiny matrix's objective section, under GRPO or with an entropy bonus."""
    from dataclasses import replace

    from qualify.matrix import GRPO, load_matrix
    from tests.conftest import TINY

    objective = load_matrix(TINY).objective
    objective = replace(objective, ppo=replace(objective.ppo, entropy_coef=entropy_coef))
    return replace(objective, algorithm="grpo", grpo=GRPO(group_size=2)) if grpo else objective


def check_static(tmp_path, monkeypatch, source: str, case_settings: dict, **objective) -> None:
    """require_static_contract on plugin_mod:Engine (source, never imported) with one case of these settings."""
    from qualify.candidate.plugin_static import require_static_contract
    from qualify.matrix import Case

    (tmp_path / "plugin_mod.py").write_text(source + "\nraise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    case = Case(engine="plugin_mod:Engine", precision="fp32", tp=1, role="actor") if not case_settings else \
        Case(**({"engine": "plugin_mod:Engine", "precision": "fp32", "tp": 1, "role": "actor"} | case_settings))
    require_static_contract("plugin_mod:Engine", [case], static_objective(**objective), where=" in m.yaml")


SOURCE_BREAKS_CONTRACT = [  # (source, case settings, objective settings, what the one line says)
    (f"class Engine:\n{ENGINE}{FIVE}", {}, {"grpo": True},
     ("class Engine's objective(role, ppo, scores_BT, response_mask_BT, targets) cannot take grpo= and share=; under "
      "GRPO it is called as objective(role, ppo, scores_BT, response_mask_BT, targets, *, grpo, share)")),
    (f"class Base:\n{FIVE}\nclass Engine(Base):\n{ENGINE}", {"dp": 2}, {},
     "class Base's objective(role, ppo, scores_BT, response_mask_BT, targets) cannot take share=; under PPO at DP 2"),
    (f"class Engine:\n{ENGINE}{FIVE}", {"packing": "packed"}, {}, "cannot take share=; under PPO packed"),
    (f"class Engine:\n{ENGINE}", {"packing": "packed"}, {},
     ("class Engine does not declare packed batches (packed = True: docs/plugins.md, 'Packed batches'; its source "
      "shows no packed attribute), so its packed case plugin_mod-Engine-fp32-tp1-packed-actor cannot run")),
    (f"class Base:\n    packed = False\n\n\nclass Engine(Base):\n{ENGINE}", {"packing": "packed"}, {},
     "its source shows packed = False (class Base)"),
    (f"class Engine(object):\n{ENGINE}", {}, {"entropy_coef": 0.01},
     ("ppo.entropy_coef 0.01 needs the entropy of the policy from the forward score() ran, and class Engine has no "
      "entropy() hook nor an objective() of its own")),
]


@pytest.mark.parametrize("source, case, objective, expect", SOURCE_BREAKS_CONTRACT)
def test_a_contract_mistake_the_source_settles_is_refused_before_any_rank(source, case, objective, expect, tmp_path,
                                                                           monkeypatch):
    """The same rule as on the ranks (objective_signature_problem, require_packed, the entropy hook), read from the
    plugin's source: one line naming the plugin, its file, what the case needs and what the source shows."""
    with pytest.raises(EngineError) as caught:
        check_static(tmp_path, monkeypatch, source, case, **objective)
    message = str(caught.value)
    assert message.startswith(f"engine plugin 'plugin_mod:Engine': {tmp_path / 'plugin_mod.py'}: ")
    assert expect in message and message.endswith(" in m.yaml") and "\n" not in message


KWARGS = "    def objective(self, role, ppo, *args, **kwargs):\n        return None\n\n"
SHARE = "    def objective(self, role, ppo, scores_BT, response_mask_BT, targets, *, share=None):\n        return None\n\n"
SOURCE_LEAVES_OPEN = [  # (source, case settings, objective settings): correct, or not settled by the source
    (f"class Engine:\n    packed = True\n\n{ENGINE}{KWARGS}", {"dp": 2, "packing": "packed"}, {"grpo": True}),
    (f"class Engine:\n    packed = True\n\n{ENGINE}{SHARE}", {"dp": 2, "packing": "packed"}, {}),
    (f"class Engine:\n{ENGINE}{FIVE}", {}, {"entropy_coef": 0.01}),  # PPO DP1 padded; its own objective: no entropy()
    (("from qualify.engines.base import OutputScoring, TrainEngine\n\n\nclass Engine(OutputScoring, TrainEngine):\n"
      "    packed = True\n"), {"packing": "packed"}, {"entropy_coef": 0.01}),
    (f"class Engine:\n{ENGINE}", {"role": "critic"}, {"entropy_coef": 0.01}),  # no entropy bonus for the critic
    (f"from elsewhere import Base\n\n\nclass Engine(Base):\n{ENGINE}{FIVE}", {"dp": 2, "packing": "packed"},
     {"entropy_coef": 0.01}),  # an imported base may bring packed, entropy() and another objective()
    (f"class Engine:\n    def __init__(self):\n        self.packed = True\n\n{ENGINE}", {"packing": "packed"}, {}),
    (f"class Engine:\n    packed = bool(1)\n\n{ENGINE}", {"packing": "packed"}, {}),
    (f"class Engine:\n{ENGINE}    @staticmethod\n    def objective(*args):\n        return None\n", {"dp": 2},
     {"grpo": True}),
    (f"class Impl:\n{ENGINE}{FIVE}\ndef Engine():\n    engine = Impl()\n    return engine\n", {"dp": 2}, {}),
]


@pytest.mark.parametrize("source, case, objective", SOURCE_LEAVES_OPEN)
def test_a_plugin_whose_source_leaves_the_contract_open_is_left_to_the_ranks(source, case, objective, tmp_path,
                                                                              monkeypatch):
    check_static(tmp_path, monkeypatch, source, case, **objective)


def test_a_def_factory_that_returns_its_class_is_held_to_the_contract(tmp_path, monkeypatch):
    """def Engine(): return Impl(): the class it makes is judged as a class factory would be; another engine's
    packed case is not this plugin's."""
    from qualify.candidate.plugin_static import require_static_contract
    from qualify.matrix import Case

    source = f"class Impl:\n{ENGINE}\n\ndef Engine():\n    return Impl()\n"
    with pytest.raises(EngineError, match="class Impl does not declare packed batches"):
        check_static(tmp_path, monkeypatch, source, {"packing": "packed"})
    other = Case(engine="torch-tp", precision="fp32", tp=1, role="actor", packing="packed")
    require_static_contract("plugin_mod:Engine", [other], static_objective())
    require_static_contract("torch-tp", [other], static_objective(entropy_coef=0.01))
