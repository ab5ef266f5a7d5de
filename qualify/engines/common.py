"""Helpers shared by engines built on Hugging Face modules (torch-tp, deepspeed).

Forward conventions match the reference (qualify.reference.hf): right-padded rows, no attention
mask, logits at t-1 score token t, the critic's head at t-1 values token t.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qualify.models.checkpoint import quiet_transformers
from qualify.ppo.logprob import sampler_logprobs


def hf_class(role: str):
    """The HF class of a role: causal LM for the actor, token classification (1 label) for the critic."""
    from transformers import Qwen3ForCausalLM, Qwen3ForTokenClassification

    return Qwen3ForCausalLM if role == "actor" else Qwen3ForTokenClassification


def load_hf(model_dir: Path, role: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Load the role's HF checkpoint in dtype, eval mode (no dropout), sdpa attention."""
    quiet_transformers()
    return hf_class(role).from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa").eval()


def score_from_logits(role: str, out_BTX: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float,
                      chunk_tokens: int, vocab_size: int) -> torch.Tensor:
    """(B, T) fp32 scores from full (unsharded) model outputs: sampler logprobs or critic values."""
    if role == "actor":
        logp_BT1 = sampler_logprobs(out_BTX[:, :-1], input_ids_BT[:, 1:], temperature, chunk_tokens, vocab_size)
        return torch.nn.functional.pad(logp_BT1, (1, 0))
    return torch.nn.functional.pad(out_BTX[:, :-1, 0].float(), (1, 0))


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
