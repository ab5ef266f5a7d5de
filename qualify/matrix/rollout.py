"""The rollout section (how vLLM samples the fixed rollout) and what a capture reads of it (Capture)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from qualify.matrix.values import MAX_SEED, Precision, at_least, distinct, finite, seed_in_range


@dataclass(kw_only=True, slots=True, frozen=True)
class Rollout:
    """How the fixed rollout is captured with vLLM."""

    vllm_tp: tuple[int, ...]
    """vLLM tensor-parallel degrees to capture; the first one's rollout feeds every later stage."""
    num_prompts: int
    """Number of prompts (sequences in the batch)."""
    prompt_len: int
    """Prompt length in tokens (prompts are drawn from the seed unless prompts_file is set)."""
    max_new_tokens: int
    """Longest response."""
    temperature: float = 1.0
    """Sampling temperature (the reference divides fp32 logits by it)."""
    top_k: int = -1
    """Top-k (-1: off)."""
    top_p: float = 1.0
    """Top-p (1.0: off)."""
    min_p: float = 0.0
    """Min-p (0.0: off): vLLM drops tokens below min_p x the top token's probability, before top-k/top-p."""
    seed: int = 0
    """Base seed: prompt i is sampled with seed + i."""
    prompts_file: str | None = None
    """Optional JSON file: a list of token-id lists (relative to the matrix file)."""
    eos_token_id: int | None = None
    """Token that ends a response early (None: the model config's)."""
    dtype: Precision = "fp32"
    """Precision vLLM samples in."""
    max_model_len: int = 256
    """vLLM max_model_len."""
    kv_cache_memory_bytes: int = 256 << 20
    """vLLM KV-cache budget in bytes."""
    block_size: int = 32
    """vLLM KV block size (prefix caching caches full blocks only)."""
    batch_invariant: bool = False
    """Capture with vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1, set before vLLM starts; its kernel settings
    are recorded with the rollout): refused with the reason where the installed vLLM or the device cannot run it."""
    layer_outputs: bool = False
    """Record, in the TP1 rollout, every decoder layer's residual stream and the final norm as vLLM's prefill of each
    sampled sequence computes them (layers.safetensors), so that an engine declared rollout_exact is told in which layer
    it first parts from vLLM's: a dense actor captured first at vLLM TP1 only."""
    routing: Literal["replay", "recompute"] | None = None
    """A MoE actor's routing in every step on the rollout: replay (the rollout's routes, recorded by the capture, pick
    the experts; routing weights come from the live router logits, so the router still gets gradients) or recompute
    (the trainer's own top-k). Required for a MoE family, refused for a dense one."""

    def __post_init__(self) -> None:
        finite(self)
        if not self.vllm_tp or any(tp < 1 for tp in self.vllm_tp):
            raise ValueError(f"vllm_tp must list degrees >= 1, got {list(self.vllm_tp)}")
        distinct("vllm_tp", self.vllm_tp)
        at_least(self, 1, "num_prompts", "prompt_len", "max_new_tokens", "max_model_len", "kv_cache_memory_bytes",
                  "block_size")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (greedy is not a sampler distribution), got {self.temperature}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        seed_in_range("seed", self.seed)
        if self.seed + self.num_prompts - 1 > MAX_SEED:
            raise ValueError("seed + num_prompts - 1 must be <= 2^63 - 1 (prompt i samples with seed + i)")
        if self.eos_token_id is not None and self.eos_token_id < 0:
            raise ValueError(f"eos_token_id must be >= 0 (a token id) or null, got {self.eos_token_id}")
        if self.prompts_file is not None and not self.prompts_file.strip():
            raise ValueError("prompts_file must be a path or null, got an empty string")
        if self.prompt_len + self.max_new_tokens > self.max_model_len:
            raise ValueError("prompt_len + max_new_tokens exceeds max_model_len")
        if self.layer_outputs and self.vllm_tp[0] != 1:
            raise ValueError(f"layer_outputs needs the primary rollout at vLLM TP1 (the first of vllm_tp, "
                             f"{list(self.vllm_tp)}): the layer capture reads vLLM's one TP1 worker (gathering and "
                             "checking every rank's hooks at TP > 1 is not built)")
        if self.layer_outputs and self.routing is not None:
            raise ValueError("layer_outputs is for a dense actor: a MoE rollout (routing set) is captured one request "
                             "at a time for its routes and never fed again")


@dataclass(kw_only=True, slots=True, frozen=True)
class Capture:
    """What sampling the rollout reads: the rollout section, the responses per prompt (GRPO's group size, else 1) and
    the prompts file resolved against the matrix file's directory (Matrix.capture makes it)."""

    rollout: Rollout
    group_size: int = 1
    prompts_file: Path | None = None

