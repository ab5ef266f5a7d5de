"""The engine plugin contract, checked on every rank before anything is judged or sealed.

What a plugin's hooks must give back, each checked where it is first used, so that a mistake is one line naming
the plugin, the hook, what was expected and what came back (the launcher adds the launch log's path):
  objective()  under GRPO it is also passed grpo= and share=: its signature must take them; under PPO it is passed
               share= where its signature takes it, and must take it at DP > 1;
               it returns (loss, outputs): the loss one differentiable number (this rank's share of the step's
               loss), outputs a dict holding every output the harness's own objective gives for the role, each
               with that output's shape and a floating dtype, and 0 off the response mask where the harness's is;
  grads()      {parameter name: tensor}; grad_dtypes() a dtype name for each of those names.
A case whose hook breaks the contract stops before its evidence is written: nothing is sealed. What a plugin's source
settles of objective()'s signature is checked before any rank starts with the same rule
(qualify.candidate.plugin_static).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from qualify.errors import EngineError


class ContractError(EngineError):
    """A plugin hook returned something other than the contract asks for."""


def _shape(t: Any) -> str:
    return f"a tensor of shape {tuple(t.shape)} ({str(t.dtype).removeprefix('torch.')})" \
        if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"


def _signature(own: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(own)
    except ValueError:  # no signature to inspect (a builtin): the call itself says
        return None


def _takes(signature: inspect.Signature, **kwargs: None) -> bool:
    try:
        signature.bind("actor", None, None, None, None, **kwargs)
    except TypeError:
        return False
    return True


def _params(signature: inspect.Signature) -> str:
    return ", ".join(("**" if p.kind is p.VAR_KEYWORD else "*" if p.kind is p.VAR_POSITIONAL else "") + p.name
                     for p in signature.parameters.values())


def objective_signature_problem(signature: inspect.Signature, grpo: bool, dp: int = 1,
                                packed: bool = False) -> str | None:
    """Why an objective() of this signature (as bound to the engine) cannot take what a case of these settings passes
    it (None: it can): under GRPO grpo= and share=, under PPO at DP > 1 or packed share=."""
    if grpo and not _takes(signature, grpo=None, share=None):
        return (f"objective({_params(signature)}) cannot take grpo= and share=; under GRPO it is called as "
                "objective(role, ppo, scores_BT, response_mask_BT, targets, *, grpo, share)")
    if not grpo and (dp > 1 or packed) and not _takes(signature, share=None):
        where = f"at DP {dp}" if dp > 1 else "packed (each micro-batch a slice of the step)"
        return (f"objective({_params(signature)}) cannot take share=; under PPO {where} it is called as "
                "objective(role, ppo, scores_BT, response_mask_BT, targets, *, share) and divides by "
                "share.normalizers, the step's counts over every DP rank")
    return None


def check_objective_signature(engine: Any, name: str, grpo: bool, dp: int = 1, packed: bool = False) -> bool:
    """Whether an engine's own objective() is given share= (the rank's share of the step: qualify.ppo.objective's
    GRPOShare or PPOShare). Under GRPO it is called with grpo= and share=, and under PPO at DP > 1 or packed (each
    micro-batch a slice of the step) with share= (its loss must be divided by the step's normalizers, summed over the
    DP ranks): refuse one that cannot take them (objective_signature_problem). A PPO objective without share= is
    called without it at DP1 padded (the rows are the whole step)."""
    own = getattr(engine, "objective", None)
    signature = None if own is None else _signature(own)
    if signature is None:  # nothing to inspect: given what the case needs, and the call itself says
        return own is not None and (grpo or dp > 1 or packed)
    problem = objective_signature_problem(signature, grpo, dp, packed)
    if problem:
        raise ContractError(f"engine {name}: {problem}")
    return grpo or _takes(signature, share=None)


def check_loss(name: str, loss: Any) -> None:
    """The loss is one differentiable number."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise ContractError(f"engine {name}: objective() returned as loss {_shape(loss)}; expected one floating "
                            "number (a 0-d tensor: this rank's share of the step's loss)")
    if not loss.requires_grad:
        raise ContractError(f"engine {name}: objective()'s loss does not require grad (it was detached or computed "
                            "without the scores): nothing could be trained from it")


def check_outputs(name: str, outputs: Any, expected: dict[str, torch.Tensor], mask_BT: torch.Tensor) -> None:
    """outputs holds every output expected holds, each of its shape, floating, and 0 off the mask where it is."""
    if not isinstance(outputs, dict):
        raise ContractError(f"engine {name}: objective() returned as outputs {_shape(outputs)}; expected a dict of "
                            f"tensors named {', '.join(sorted(expected))}")
    missing = sorted(set(expected) - set(outputs))
    if missing:
        raise ContractError(f"engine {name}: objective()'s outputs lack {', '.join(missing)} (it gave "
                            f"{', '.join(sorted(outputs)) or 'none'}; the role's outputs are "
                            f"{', '.join(sorted(expected))})")
    for key, want in sorted(expected.items()):
        got = outputs[key]
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape) or not got.is_floating_point():
            raise ContractError(f"engine {name}: objective()'s output {key} is {_shape(got)}; expected a floating "
                                f"tensor of shape {tuple(want.shape)}")
        if key.endswith("_BT") and tuple(want.shape) == tuple(mask_BT.shape) and not bool((want[~mask_BT] == 0).all()):
            continue  # the harness's own is not 0 off the mask: nothing to hold the engine's to
        if key.endswith("_BT") and tuple(want.shape) == tuple(mask_BT.shape):
            off = got.detach()[~mask_BT.to(got.device)]
            if bool((off != 0).any()):
                raise ContractError(f"engine {name}: objective()'s output {key} is not 0 off the response mask "
                                    f"({int((off != 0).sum())} prompt or padding positions hold values, max "
                                    f"|x| {float(off.abs().max()):.3g}); outputs are per response token")


def check_grads(name: str, grads: Any, dtypes: Any) -> None:
    """grads() is a dict of tensors; grad_dtypes() gives a dtype name for each parameter grads() names."""
    if not isinstance(grads, dict) or not all(isinstance(t, torch.Tensor) for t in grads.values()):
        raise ContractError(f"engine {name}: grads() returned {_shape(grads)}; expected a dict of parameter name -> "
                            "tensor (HF names, full tensors)")
    if not isinstance(dtypes, dict) or not set(grads) <= set(dtypes) or \
            not all(isinstance(dtypes[n], str) for n in grads):
        got = f"{len(dtypes)} names" if isinstance(dtypes, dict) else _shape(dtypes)
        raise ContractError(f"engine {name}: grad_dtypes() returned {got}; expected a dtype name (e.g. 'float32') "
                            f"for each of the {len(grads)} parameters grads() names")
