"""Qualification matrices: YAML files loaded into frozen, validated dataclasses.

A matrix says which models to qualify, how the rollout is captured, which PPO
and optimizer settings the reference uses, how bounds are frozen and which
candidate cases run. matrices/README.md documents every field.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from qualify.schema import load_yaml_file

Precision = Literal["fp32", "bf16"]
Role = Literal["actor", "critic"]
Perturbation = Literal["microbatch_split", "batch_order", "attn_impl"]
TokenNormalizer = Literal["global", "per_sequence", "constant"]
Topology = Literal["dedicated", "shared"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16")
METRIC_KINDS = ("logprob", "value", "loss", "grad", "grad_norm", "update", "moment", "target", "relative")


@dataclass(kw_only=True, slots=True, frozen=True)
class TinyModel:
    """A tiny Qwen3 family made locally from a seed (no hub download)."""

    seed: int
    """Seed for every weight of actor, reference, critic and reward."""
    vocab_size: int
    """Vocabulary size; a size that is not a multiple of 64 x TP exercises vocab padding."""
    hidden_size: int = 64
    """Hidden width."""
    intermediate_size: int = 128
    """MLP width."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 32
    """Head dimension; vLLM's CPU attention needs at least 32."""
    initializer_range: float = 0.1
    """Std of the initial weights; 0.1 gives logits that are not flat."""
    max_position_embeddings: int = 512
    """Longest sequence the model accepts."""
    rope_theta: float = 10000.0
    """RoPE base."""

    def __post_init__(self) -> None:
        if self.head_dim < 32:
            raise ValueError(f"head_dim {self.head_dim} < 32: vLLM's CPU attention needs head_dim >= 32")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.vocab_size < 8:
            raise ValueError(f"vocab_size {self.vocab_size} too small (>= 8)")


@dataclass(kw_only=True, slots=True, frozen=True)
class Checkpoints:
    """Local checkpoint directories of a real model family (nothing is downloaded)."""

    actor: str
    """HF Qwen3ForCausalLM directory: the policy being trained."""
    reference: str
    """HF Qwen3ForCausalLM directory: the frozen reference policy for KL."""
    critic: str
    """HF Qwen3ForTokenClassification (num_labels=1) directory: the value model."""
    reward: str
    """HF Qwen3ForTokenClassification (num_labels=1) directory: the frozen reward model."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Models:
    """Where the model family comes from: exactly one of tiny or checkpoints."""

    tiny: TinyModel | None = None
    """Make a tiny Qwen3 family locally."""
    checkpoints: Checkpoints | None = None
    """Use local checkpoint directories (relative to the matrix file or absolute)."""

    def __post_init__(self) -> None:
        if (self.tiny is None) == (self.checkpoints is None):
            raise ValueError("set exactly one of 'tiny' or 'checkpoints'")


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

    def __post_init__(self) -> None:
        if not self.vllm_tp or any(tp < 1 for tp in self.vllm_tp):
            raise ValueError(f"vllm_tp must list degrees >= 1, got {self.vllm_tp}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (greedy is not a sampler distribution), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.prompt_len + self.max_new_tokens > self.max_model_len:
            raise ValueError("prompt_len + max_new_tokens exceeds max_model_len")


@dataclass(kw_only=True, slots=True, frozen=True)
class PPO:
    """PPO objective settings shared by the reference and every candidate."""

    clip_eps: float = 0.2
    """Policy ratio clip range."""
    value_clip_eps: float = 0.2
    """Value clip range around the old values."""
    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda."""
    kl_coef: float = 0.05
    """Per-token KL penalty folded into rewards."""
    token_normalizer: TokenNormalizer = "global"
    """How token losses are averaged: over all active tokens, per sequence then mean, or by a constant."""
    normalizer_constant: float | None = None
    """Divisor when token_normalizer is 'constant'."""

    def __post_init__(self) -> None:
        if (self.token_normalizer == "constant") != (self.normalizer_constant is not None):
            raise ValueError("normalizer_constant is required with token_normalizer 'constant' and only then")


@dataclass(kw_only=True, slots=True, frozen=True)
class Optimizer:
    """AdamW settings of the single optimizer step."""

    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (0: no clipping)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Reference:
    """The independent Hugging Face reference and its controls."""

    precisions: tuple[Precision, ...] = PRECISIONS
    """Precisions to score; bounds need both fp32 and bf16."""
    repeats: int = 2
    """Independent repeats per precision (at least two)."""
    perturbations: tuple[Perturbation, ...] = ()
    """Extra numerically legitimate controls per precision."""
    logprob_chunk_tokens: int = 64
    """Tokens per chunk of the fp32 log_softmax (never a [tokens, vocab] fp32 tensor)."""
    gradient_checkpointing: bool = False
    """Checkpoint activations in the reference backward."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the reference runs."""

    def __post_init__(self) -> None:
        if self.repeats < 2:
            raise ValueError(f"repeats must be >= 2 (controls need independent repeats), got {self.repeats}")
        if self.logprob_chunk_tokens < 1:
            raise ValueError("logprob_chunk_tokens must be >= 1")


@dataclass(kw_only=True, slots=True, frozen=True)
class Freeze:
    """The acceptance rule: bound = k x control error + floor."""

    k: float = 4.0
    """Multiplier on the control error."""
    floors: dict[str, float] = field(default_factory=dict)
    """Floor per metric kind: absolute floors for max_abs of logprob, value, loss, grad, grad_norm, update, moment,
    target tensors; 'relative' is the floor of every relative metric (rel_l2)."""
    quantum: bool = True
    """Add one rounding step of the family's precision (ulp at the reference magnitude) to each bound."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.floors) - set(METRIC_KINDS))
        if unknown:
            raise ValueError(f"unknown floor kinds {unknown} (allowed: {', '.join(METRIC_KINDS)})")
        missing = sorted(set(METRIC_KINDS) - set(self.floors))
        if missing:
            raise ValueError(f"floors missing for {missing}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")


@dataclass(kw_only=True, slots=True, frozen=True)
class Candidates:
    """The candidate matrix: every combination of these runs as one case."""

    engines: tuple[str, ...]
    """Engine names from the registry, or 'module:factory' for a user's own engine."""
    precisions: tuple[Precision, ...] = PRECISIONS
    """Precisions."""
    tp: tuple[int, ...] = (1,)
    """Tensor-parallel degrees."""
    roles: tuple[Role, ...] = ("actor", "critic")
    """Roles."""
    topologies: tuple[Topology, ...] = ("dedicated",)
    """GPU topologies for Slurm: dedicated = actor_tp + critic_tp + vllm_tp GPUs, shared = max of them."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Case:
    """One candidate case."""

    engine: str
    precision: Precision
    tp: int
    role: Role

    @property
    def name(self) -> str:
        safe = self.engine.replace(":", "-").replace(".", "-")
        return f"{safe}-{self.precision}-tp{self.tp}-{self.role}"


@dataclass(kw_only=True, slots=True, frozen=True)
class Matrix:
    """A whole qualification matrix."""

    name: str
    """Name; runs go to runs/<name> by default."""
    description: str = ""
    """One line for people."""
    models: Models
    """The model family."""
    rollout: Rollout
    """Rollout capture."""
    ppo: PPO = field(default_factory=PPO)
    """PPO settings."""
    optimizer: Optimizer = field(default_factory=Optimizer)
    """AdamW settings."""
    reference: Reference = field(default_factory=Reference)
    """Reference and controls."""
    freeze: Freeze
    """Bound rule."""
    candidates: Candidates
    """Candidate matrix."""
    source: str = ""
    """Path of the YAML file (set by the loader)."""

    def __post_init__(self) -> None:
        if set(self.reference.precisions) != set(PRECISIONS):
            raise ValueError("reference.precisions must be [fp32, bf16]: the bound families need both")

    def cases(self) -> list[Case]:
        """Every case of the candidate matrix, in a stable order."""
        c = self.candidates
        return [Case(engine=e, precision=p, tp=t, role=r)
                for e, p, t, r in itertools.product(c.engines, c.precisions, c.tp, c.roles)]

    def resolve(self, path: str) -> Path:
        """A path from the matrix, relative to the matrix file's directory."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else (Path(self.source).parent / p)


def load_matrix(path: Path | str) -> Matrix:
    """Read and validate a matrix YAML file."""
    return load_yaml_file(Matrix, path, "matrix file", {"source": str(path)})


def matrix_files(directory: Path) -> list[Path]:
    """Matrix files in a directory."""
    return sorted(p for p in Path(directory).glob("*.yaml"))
