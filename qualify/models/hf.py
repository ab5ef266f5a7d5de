"""Hugging Face models of the family: the one loader and the one scorer, for the reference and every engine.

Conventions (shared by the reference and every engine): sequences are right-padded, positions are 0..T-1,
and causal attention means padding never influences a real token, so no attention mask is passed.
logp_BT[:, t] = log p(token t | tokens < t) comes from the logits at t-1; values_BT[:, t] is the critic's
head at t-1 (the state in which token t is emitted); the reward model is pooled at the last response token.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from qualify.errors import EngineError
from qualify.models.checkpoint import quiet_transformers
from qualify.models.precision import torch_dtype
from qualify.ppo.entropy import sampler_entropy
from qualify.ppo.formula import Sampling, formula_logprobs
from qualify.ppo.logprob import sampler_logprobs
from qualify.ppo.math import last_active_index

LM_ROLES = ("actor", "reference")
"""Roles whose checkpoint is a causal LM; the others (critic, reward) have a one-label scalar head."""


MODEL_TYPES = ("qwen3", "qwen3_moe")
"""The checkpoints' model_type: dense Qwen3 and Qwen3-MoE."""


def hf_class(role: str, model_type: str = "qwen3"):
    """The HF class of a role: causal LM for the actor and the reference policy, token classification else; Qwen3 or
    Qwen3-MoE by the checkpoint's model_type."""
    import transformers

    if model_type not in MODEL_TYPES:
        raise EngineError(f"model_type {model_type!r} is not one qualify loads ({', '.join(MODEL_TYPES)})")
    prefix = "Qwen3Moe" if model_type == "qwen3_moe" else "Qwen3"
    return getattr(transformers, prefix + ("ForCausalLM" if role in LM_ROLES else "ForTokenClassification"))


def model_type(model_dir: Path) -> str:
    """The checkpoint's model_type (config.json)."""
    import json

    config = Path(model_dir) / "config.json"
    try:
        return json.loads(config.read_text())["model_type"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"{config}: no readable model_type ({exc})") from None


def load_model(model_dir: Path, role: str, attn_impl: str = "sdpa", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Load the role's HF checkpoint in dtype (fp32: the master weights), in eval mode, with no dropout active."""
    quiet_transformers()
    cls = hf_class(role, model_type(model_dir))
    model = cls.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=attn_impl)
    return model.eval()


def compute_copy(master: torch.nn.Module, precision: str, model_dir: Path, role: str,
                 attn_impl: str) -> torch.nn.Module:
    """The module the forward/backward runs in: the master itself in fp32; in bf16 the checkpoint loaded
    the way transformers loads bf16 (RoPE inv_freq stays fp32: a blanket .to(bf16) would round it too),
    holding exactly the master weights rounded to bf16."""
    if precision == "fp32":
        return master
    model = load_model(model_dir, role, attn_impl, torch_dtype(precision))
    with torch.no_grad():
        for mp, cp in zip(master.parameters(), model.parameters()):
            cp.copy_(mp)  # round-to-nearest of the current master, whatever the checkpoint held
    return model


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Turn on activation checkpointing for real: transformers only checkpoints in train mode."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p != 0:
            raise EngineError(f"the checkpoint has dropout p={module.p}: train-mode activation checkpointing would "
                              "make the reference non-deterministic; use a checkpoint without dropout")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def scores_from_outputs(role: str, out_BTX: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float,
                        chunk_tokens: int, vocab_size: int) -> torch.Tensor:
    """(B, T) fp32 scores from full (unsharded) model outputs: the actor's sampler-formula logprobs (position 0,
    which has no context, is 0) or the critic's values (the head at t-1 values token t; position 0 is 0)."""
    if role in LM_ROLES:
        logp_BT1 = sampler_logprobs(out_BTX[:, :-1], input_ids_BT[:, 1:], temperature, chunk_tokens, vocab_size)
        return torch.nn.functional.pad(logp_BT1, (1, 0))
    return torch.nn.functional.pad(out_BTX[:, :-1, 0].float(), (1, 0))


def entropy_from_outputs(logits_BTV: torch.Tensor, temperature: float, chunk_tokens: int,
                         vocab_size: int) -> torch.Tensor:
    """(B, T) fp32 entropy of the sampler's distribution that scores token t (the logits at t - 1: aligned with the
    logprobs; position 0 is 0), differentiable (qualify.ppo.entropy)."""
    h_BT1 = sampler_entropy(logits_BTV[:, :-1], temperature, chunk_tokens, vocab_size)
    return torch.nn.functional.pad(h_BT1, (1, 0))


def logprobs_from_outputs(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, formula: str, sampling: Sampling,
                          chunk_tokens: int, vocab_size: int) -> torch.Tensor:
    """(B, T) fp32 logprobs of input_ids in the named formula (qualify.ppo.formula), no gradient; position 0 is 0."""
    logp_BT1 = formula_logprobs(logits_BTV[:, :-1], input_ids_BT[:, 1:], formula, sampling, chunk_tokens, vocab_size)
    return torch.nn.functional.pad(logp_BT1, (1, 0))


class DeclaredFormula(Protocol):
    """What declared_logprobs reads of an engine's context (qualify.engines.base.EngineContext has it all)."""

    role: str
    logprob_formula: str
    logprob_chunk_tokens: int
    vocab_size: int

    def sampling(self) -> Sampling: ...


def declared_logprobs(ctx: DeclaredFormula, out_BTX: torch.Tensor, input_ids_BT: torch.Tensor) -> torch.Tensor | None:
    """An engine's logprobs in its declared formula (ctx.logprob_formula) from full model outputs, for its
    logprobs() hook; None where score()'s own values are them (the critic, or the full formula)."""
    if ctx.role not in LM_ROLES or ctx.logprob_formula == "full":
        return None
    return logprobs_from_outputs(out_BTX, input_ids_BT, ctx.logprob_formula, ctx.sampling(), ctx.logprob_chunk_tokens,
                                 ctx.vocab_size).cpu()


def actor_logprobs(model: torch.nn.Module, input_ids_BT: torch.Tensor, temperature: float, chunk_tokens: int,
                   vocab_size: int) -> torch.Tensor:
    """(B, T) fp32 sampler-formula logprobs of input_ids under an HF causal LM."""
    logits_BTV = model(input_ids=input_ids_BT, use_cache=False).logits
    return scores_from_outputs("actor", logits_BTV, input_ids_BT, temperature, chunk_tokens, vocab_size)


class ActorScores(NamedTuple):
    """What the actor's one forward gives the objective and the evidence."""

    scores_BT: torch.Tensor
    """(B, T) fp32 full-formula logprobs, differentiable: what the loss is built from."""
    processed_BT: torch.Tensor | None
    """The processed formula's (no gradient) when the sampling truncates; None when it does not (then they are
    bitwise the full ones)."""
    entropy_BT: torch.Tensor | None
    """(B, T) fp32 entropy of the same forward's sampler distribution, differentiable, when asked for; else None."""


def actor_scores(model: torch.nn.Module, input_ids_BT: torch.Tensor, sampling: Sampling, chunk_tokens: int,
                 vocab_size: int, entropy: bool = False, position_ids: torch.Tensor | None = None) -> ActorScores:
    """One forward of the actor: its logprobs, processed logprobs and (entropy: True) entropy (ActorScores).
    position_ids: a packed row's (1, N), restarting at each sample (transformers then attends within each sample; the
    caller zeroes each sample's first token, scored here from the previous sample)."""
    logits_BTV = model(input_ids=input_ids_BT, position_ids=position_ids, use_cache=False).logits
    scores_BT = scores_from_outputs("actor", logits_BTV, input_ids_BT, sampling.temperature, chunk_tokens, vocab_size)
    entropy_BT = entropy_from_outputs(logits_BTV, sampling.temperature, chunk_tokens, vocab_size) if entropy else None
    if not sampling.truncates(vocab_size):
        return ActorScores(scores_BT, None, entropy_BT)
    return ActorScores(scores_BT, logprobs_from_outputs(logits_BTV.detach(), input_ids_BT, "processed", sampling,
                                                        chunk_tokens, vocab_size), entropy_BT)


def head_outputs(model: torch.nn.Module, input_ids_BT: torch.Tensor,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) fp32 scalar-head outputs at every position."""
    return model(input_ids=input_ids_BT, position_ids=position_ids, use_cache=False).logits[..., 0].float()


def critic_values(model: torch.nn.Module, input_ids_BT: torch.Tensor,
                  position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) fp32 values of an HF scalar-head model (position_ids: as actor_scores takes them)."""
    return torch.nn.functional.pad(head_outputs(model, input_ids_BT, position_ids)[:, :-1], (1, 0))


def reward_scores(model: torch.nn.Module, input_ids_BT: torch.Tensor, response_mask_BT: torch.Tensor) -> torch.Tensor:
    """(B,) fp32 rewards pooled at each row's last response token; 0 for a row without response."""
    out_BT = head_outputs(model, input_ids_BT)
    last_B, has_any_B = last_active_index(response_mask_BT)
    pooled_B = out_BT.gather(1, last_B[:, None])[:, 0]
    return torch.where(has_any_B, pooled_B, torch.zeros_like(pooled_B))


def dtype_name(t: torch.Tensor) -> str:
    """'float32', 'bfloat16', ...: a tensor's dtype as evidence records it."""
    return str(t.dtype).removeprefix("torch.")
