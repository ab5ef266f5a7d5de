"""Qualification matrices: YAML files loaded into frozen, validated dataclasses.

A matrix says which models to qualify, how the rollout is captured, which PPO
and optimizer settings the reference uses, how bounds are frozen and which
candidate cases run. matrices/README.md documents every field.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from qualify.errors import MatrixError
from qualify.schema import load_yaml_file
from qualify.waivers import WAIVABLE, unknown_checks

Precision = Literal["fp32", "bf16"]
Role = Literal["actor", "critic"]
Perturbation = Literal["microbatch_split", "batch_order", "attn_impl", "tp_split", "fused_projections",
                       "optimizer_order", "fused_adam", "fused_norm", "packed", "combined"]
TokenNormalizer = Literal["global", "per_sequence", "constant"]
Topology = Literal["dedicated", "shared"]
LogprobFormula = Literal["full", "processed"]
Algorithm = Literal["ppo", "grpo"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3", "k3_ratio"]
ClipFrac = Literal["loss_weighted", "token_mean"]
StdEstimator = Literal["population", "unbiased"]
Packing = Literal["padded", "packed"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16")
METRIC_KINDS = ("logprob", "value", "loss", "grad", "grad_norm", "update", "target", "relative")
MAX_SEED = 2**63 - 1
# A matrix name becomes a directory (runs/<name>) and a Slurm job name: plain ASCII, no path separators.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
# A plugin engine is 'package.module:factory'; case names and directories are made from it.
_PLUGIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
BUILTIN_ENGINES = ("torch-tp", "deepspeed", "megatron", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3",
                   "megatron-distopt", "fsdp2")
"""The engines qualify ships (qualify.engines.registry builds each by name); any other is a 'module:factory' plugin."""
DEEPSPEED_ENGINES = ("deepspeed", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3")
"""DeepSpeed at ZeRO stage 0 (plain deepspeed) to 3, the stage each one's index: one adapter, the stage its setting."""
MEGATRON_ENGINES = ("megatron", "megatron-distopt")
"""Megatron without and with its distributed optimizer: one adapter, the optimizer its setting."""
_MEGATRON_UNPACKED = ("megatron-core's local layer spec (no Transformer Engine) attends with DotProductAttention, which "
                      "refuses packed sequences (its THD format, PackedSeqParams with cu_seqlens, needs "
                      "TEDotProductAttention)")
UNPACKED_ENGINES = {name: _MEGATRON_UNPACKED for name in MEGATRON_ENGINES}
"""Built-in engines that cannot take packed batches, and why (a plugin says it can with a class attribute packed = True:
qualify.engines.base.TrainEngine)."""


def engine_name_problem(name: str) -> str | None:
    """Why name is not an engine a matrix may name (None: a built-in name or a 'package.module:factory' plugin).
    The one check of engine names: the matrix's sections and the registry use it."""
    if name in BUILTIN_ENGINES or _PLUGIN.fullmatch(name):
        return None
    return (f"unknown engine {name!r} (known: {', '.join(sorted(BUILTIN_ENGINES))}; "
            "or 'package.module:factory' for a plugin)")


def _finite(obj: Any) -> None:
    """Every float field of a config dataclass (alone, in a tuple or a dict) is finite: YAML reads .nan and .inf."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, tuple) else None
        for key, v in items if items is not None else [(None, value)]:
            if isinstance(v, float) and not math.isfinite(v):
                where = f.name if key is None else f"{f.name}[{key}]" if isinstance(key, int) else f"{f.name}.{key}"
                raise ValueError(f"{where} must be a finite number, got {v}")


def _at_least(obj: Any, low: float, *names: str) -> None:
    """Each named numeric field is >= low."""
    for name in names:
        value = getattr(obj, name)
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def _positive(obj: Any, *names: str) -> None:
    """Each named float field is > 0."""
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def _distinct(name: str, values: tuple, *, nonempty: bool = True) -> None:
    """A list field names each value once (and names at least one when nonempty)."""
    if nonempty and not values:
        raise ValueError(f"{name} must list at least one value")
    repeated = sorted({v for v in values if values.count(v) > 1}, key=str)
    if repeated:
        raise ValueError(f"{name} lists {repeated} more than once (each value at most once)")


def _seed(name: str, value: int) -> None:
    if not 0 <= value <= MAX_SEED:
        raise ValueError(f"{name} must be in [0, 2^63 - 1], got {value}")


MAX_TINY_SIZE = 1 << 20
"""The largest any dimension of a tiny family may be (a width, a count, the vocabulary): beyond it no machine holds the
model, and torch fails on it (qualify.memory.tiny_family_problem then bounds the whole family by this machine's
memory)."""


def _at_most_tiny(obj: Any, *names: str) -> None:
    """Each named size is <= MAX_TINY_SIZE."""
    for name in names:
        value = getattr(obj, name)
        if value > MAX_TINY_SIZE:
            raise ValueError(f"{name} {value} is over {MAX_TINY_SIZE}: a tiny family's sizes are bounded (its models "
                             "are made in this machine's memory)")


@dataclass(kw_only=True, slots=True, frozen=True)
class TinyMoE:
    """Mixture-of-experts layers for the tiny family's policies (Qwen3-MoE: every decoder layer's MLP is a router and
    experts, top-k routing with a softmax over all experts); the critic and the reward model stay dense."""

    num_experts: int = 4
    """Experts per MoE layer."""
    top_k: int = 2
    """Experts each token is routed to (num_experts_per_tok)."""
    moe_intermediate_size: int = 32
    """Each expert's MLP width."""
    norm_topk_prob: bool = True
    """Renormalize the top-k routing weights to sum to 1 (Qwen3-MoE's setting)."""

    def __post_init__(self) -> None:
        _at_least(self, 2, "num_experts")
        _at_least(self, 1, "top_k", "moe_intermediate_size")
        _at_most_tiny(self, "num_experts", "moe_intermediate_size")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} is more than num_experts {self.num_experts}")


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
    tie_word_embeddings: bool | None = None
    """true: actor and reference policy share the embedding with the LM head (as Qwen3-0.6B does); unset: untied
    (None rather than false, so that snapshots frozen before this key existed still compare equal)."""
    moe: TinyMoE | None = None
    """Mixture-of-experts policies (actor and reference policy are Qwen3-MoE; critic and reward stay dense); unset:
    a dense family."""

    def __post_init__(self) -> None:
        _finite(self)
        _seed("seed", self.seed)
        _at_least(self, 1, "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "max_position_embeddings")
        _at_most_tiny(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim", "max_position_embeddings")
        _positive(self, "initializer_range", "rope_theta")
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
        _finite(self)
        if not self.vllm_tp or any(tp < 1 for tp in self.vllm_tp):
            raise ValueError(f"vllm_tp must list degrees >= 1, got {list(self.vllm_tp)}")
        _distinct("vllm_tp", self.vllm_tp)
        _at_least(self, 1, "num_prompts", "prompt_len", "max_new_tokens", "max_model_len", "kv_cache_memory_bytes",
                  "block_size")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (greedy is not a sampler distribution), got {self.temperature}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        _seed("seed", self.seed)
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
class PPO:
    """PPO objective settings shared by the reference and every candidate."""

    clip_eps: float = 0.2
    """Policy ratio clip range: the ratio is clipped to [1 - clip_eps_low, 1 + clip_eps_high], each clip_eps unless set
    (qualify.ppo.math.policy_settings reads them)."""
    clip_eps_low: float | None = None
    """The lower edge's own range (verl clip_ratio_low): 1 - clip_eps_low, in (0, 1); unset: clip_eps."""
    clip_eps_high: float | None = None
    """The upper edge's own range (verl clip_ratio_high, TRL epsilon_high, DAPO's clip-higher): 1 + clip_eps_high;
    unset: clip_eps."""
    dual_clip_c: float | None = None
    """Dual clip (verl clip_ratio_c): a negative-advantage token's loss is at most -A x dual_clip_c, > 1; unset: off."""
    entropy_coef: float = 0.0
    """Entropy bonus (verl entropy_coeff): the policy loss less entropy_coef x the entropy of the full-vocabulary
    sampler distribution (logits / temperature) at each response token, aggregated as the policy loss; 0: off."""
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
    epochs: int = 1
    """Passes over the fixed rollout; K = epochs x minibatches optimizer steps (old logprobs stay the rollout's)."""
    minibatches: int = 1
    """Contiguous, equal slices of the rollout's rows per epoch, one optimizer step each."""
    whiten_advantages: bool = False
    """Whiten the GAE advantages over the rollout's response tokens, after the returns are made from them (verl's
    default: (A - mean) / sqrt(var + 1e-8), var unbiased); false keeps them as GAE gives them."""

    def __post_init__(self) -> None:
        _finite(self)
        _at_least(self, 1, "epochs", "minibatches")
        _positive(self, "clip_eps", "value_clip_eps")
        _at_least(self, 0, "kl_coef", "entropy_coef")
        if self.clip_eps_low is not None and not 0 < self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low must be in (0, 1) (the lower edge 1 - clip_eps_low is a positive ratio), "
                             f"got {self.clip_eps_low}")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            raise ValueError(f"clip_eps_high must be > 0, got {self.clip_eps_high}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            raise ValueError(f"dual_clip_c must be > 1 (the dual clip bounds a ratio above 1; null turns it off), got "
                             f"{self.dual_clip_c}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if (self.token_normalizer == "constant") != (self.normalizer_constant is not None):
            raise ValueError("normalizer_constant is required with token_normalizer 'constant' and only then")
        if self.normalizer_constant is not None and self.normalizer_constant <= 0:
            raise ValueError(f"normalizer_constant must be > 0, got {self.normalizer_constant}")


PPO_ADDED = {"clip_eps_low": None, "clip_eps_high": None, "dual_clip_c": None, "entropy_coef": 0.0}
"""PPO fields added after references and cases were sealed, with the values that leave the objective as it was."""


def ppo_as_before(ppo: dict[str, Any]) -> dict[str, Any]:
    """A ppo section's plain data (schema.to_dict) without the PPO_ADDED fields that hold their defaults: what the
    scoring fingerprint and a case's spec take, so that an unchanged matrix's fingerprint and resume keys read as
    before those fields existed (a sealed snapshot reads them as their defaults: acceptance.read_snapshot)."""
    return {k: v for k, v in ppo.items() if not (k in PPO_ADDED and v == PPO_ADDED[k])}


@dataclass(kw_only=True, slots=True, frozen=True)
class GRPO:
    """GRPO settings (algorithm: grpo): group-relative advantages, KL to the reference policy in the loss, and the
    loss aggregation. The ppo section's policy clip (clip_eps, clip_eps_low, clip_eps_high, dual_clip_c), entropy_coef,
    epochs and minibatches apply to GRPO too; nothing else of it does."""

    group_size: int
    """Responses per prompt: vLLM samples each prompt group_size times (each response with its own seed); a group
    is group_size contiguous rows, and the batch holds rollout.num_prompts x group_size rows."""
    scale_std: bool = True
    """true: advantages (r - group mean) / (group std + eps) (GRPO); false: r - group mean (Dr. GRPO)."""
    std_estimator: StdEstimator = "unbiased"
    """Group std: 'unbiased' (divides by n - 1, as TRL and verl) or 'population' (by n)."""
    eps: float = 1.0e-6
    """Added to the group std before dividing."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL(policy || reference) estimator in the loss: k1 (log ratio), k2 (half its square), k3 (Schulman's),
    k3_ratio (k3 times the differentiable ratio to the old policy: TRL's use_bias_correction_kl)."""
    kl_coef: float = 0.04
    """Coefficient of the KL term in the loss (0: no KL term)."""
    clip_frac: ClipFrac = "loss_weighted"
    """The reported clip fraction: 1[clipped] aggregated as the loss is ('loss_weighted'), or its mean over the step's
    active tokens ('token_mean', as verl and TRL report it under every aggregation)."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become the loss: 'token_mean' (over the global active tokens), 'seq_mean_token_mean'
    (mean over sequences of each sequence's token mean), 'seq_mean_token_sum_norm' (Dr. GRPO: each sequence's token
    sum over a fixed constant, then the mean over sequences)."""
    constant: float | None = None
    """The Dr. GRPO constant (for example the longest response): required with seq_mean_token_sum_norm, only then."""

    def __post_init__(self) -> None:
        _finite(self)
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (a group of one has no relative advantage), got "
                             f"{self.group_size}")
        _positive(self, "eps")
        _at_least(self, 0, "kl_coef")
        if (self.aggregation == "seq_mean_token_sum_norm") != (self.constant is not None):
            raise ValueError("constant is required with aggregation 'seq_mean_token_sum_norm' and only then "
                             f"(aggregation is {self.aggregation!r}, constant {self.constant})")
        if self.constant is not None and not self.constant > 0:
            raise ValueError(f"constant must be > 0, got {self.constant}")


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

    def __post_init__(self) -> None:
        _finite(self)
        _positive(self, "lr", "eps")
        _at_least(self, 0, "weight_decay", "max_grad_norm")
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")


@dataclass(kw_only=True, slots=True, frozen=True)
class Reference:
    """The independent Hugging Face reference and its controls."""

    precisions: tuple[Precision, ...] = PRECISIONS
    """Precisions to score; bounds need both fp32 and bf16."""
    repeats: int = 2
    """Independent repeats per precision (at least two)."""
    perturbations: tuple[Perturbation, ...] = ()
    """Extra numerically legitimate controls per precision: microbatch_split (two micro-batches, gradients
    accumulated), batch_order (rows reversed), attn_impl (eager attention), tp_split (one control per
    candidates.tp degree n > 1 at reference time, named tp<n>_split: the reference computed with TP n's reduction
    orders, qualify.reference.tp_numerics; none when candidates.tp has no degree above 1), fused_projections (each
    layer's q/k/v and gate/up as one GEMM, as Megatron computes them: qualify engines that fuse with it),
    optimizer_order (AdamW's arithmetic in another order, as engines' own optimizers round it: every engine steps its
    own optimizer, so qualify every engine with it; qualify.reference.adam_order), fused_adam (AdamW in the form of
    apex's and Transformer Engine's FusedAdam, which Megatron steps: the decay folded into the update and the parameter
    rounded once, a shift common to every entry that bias and norm-weight gradients sum whole), fused_norm (each
    RMSNorm as one fused kernel, F.rms_norm, rounding once, as Megatron, apex and Transformer Engine compute it),
    packed (each step's rows packed into micro-batches of candidates.pack_tokens tokens, as a packed case trains on
    them: position ids restarting per sample, attention within each sample, gradients accumulated over the
    micro-batches with the step's normalizers; qualify.case.packing; required when candidates.packing lists packed),
    combined (one more control with every other listed perturbation at once, tp_split at the largest candidates.tp
    degree, of two optimizer forms the one listed last: an engine differs from the reference in several of these ways
    together, and its error is their sum, which no single control samples; needs at least two others)."""
    logprob_chunk_tokens: int = 64
    """Tokens per chunk of the fp32 log_softmax (never a [tokens, vocab] fp32 tensor)."""
    gradient_checkpointing: bool = False
    """Checkpoint activations in the reference backward."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the reference's forward and backward run."""
    offload: Literal["host"] | None = None
    """host: the FP32 master, its gradients and the AdamW state stay in host memory, only the compute copy is on the
    device (fits a model whose optimizer state one GPU cannot hold); unset: everything on the device."""
    layer_activations: bool = True
    """Keep step 1's per-layer activations of every reference run (what `qualify diagnose` localizes a failing case
    with, and its per-layer bounds are frozen from); false leaves them out (a fifth of an r0 run's bytes at the
    Qwen3-0.6B shape: matrices/README.md) and diagnose then refuses, naming this field."""
    evidence: Literal["summary", "lean", "full"] = "summary"
    """What the reference keeps of each control (every run but a precision's r0, against which candidates are judged):
    summary: its outputs and the control errors freeze needs, measured while it ran (qualify.bounds.records), so the
    evidence grows with the model and the steps, not with the number of controls; lean: as summary, and each r0
    keeps only what candidates are judged against (outputs and gradients: 4 bytes per parameter per step, not 16),
    its updates and moments replaced by what freeze needs of them (their magnitudes, r0's own AdamW replay, its
    start's magnitudes; qualify.bounds.records.base_record); full: every tensor of every control, for a reviewer who
    measures them again. The bounds are the same in all three."""

    def __post_init__(self) -> None:
        _distinct("precisions", self.precisions)
        _distinct("perturbations", self.perturbations, nonempty=False)
        if "combined" in self.perturbations and len(self.perturbations) < 3:
            raise ValueError("perturbations: combined applies every other listed perturbation at once and needs at "
                             f"least two others, got {list(self.perturbations)}")
        if self.repeats < 2:
            raise ValueError(f"repeats must be >= 2 (controls need independent repeats), got {self.repeats}")
        if self.logprob_chunk_tokens < 1:
            raise ValueError("logprob_chunk_tokens must be >= 1")


@dataclass(kw_only=True, slots=True, frozen=True)
class Freeze:
    """The acceptance rule's settings: bound = k * control_error + floor + quantum (qualify.bounds.rule.FORMULA; the
    quantum, one rounding step of the compute precision, is not a setting)."""

    k: float = 4.0
    """Multiplier on the control error."""
    floors: dict[str, float] = field(default_factory=dict)
    """Absolute floor per metric kind, the least any bound of that kind gets: logprob, value, loss, grad, grad_norm,
    update, target tensors; 'relative' for every relative metric (rel_l2). AdamW's moments have no bound: they are
    judged by derivation from the case's own gradients (qualify.candidate.derived). Each bound's floor is the larger
    of this and floor_ulps fp32 rounding steps of the tensor's own magnitude, so keep these small: the control
    error, not a floor, should set a bound."""
    floor_ulps: float = 4.0
    """Per-tensor floor in fp32 rounding steps (ulps) at the reference tensor's largest magnitude (rel_l2: of 1)."""
    quantum: bool = True
    """Add one rounding step of the compute precision (its ulp at the reference magnitude) to the bounds of what the
    contract computes in that precision: in the bf16 families gradients and the critic's values;
    every update carries one fp32 step of its parameter. Quantities computed in fp32 (logprobs, ratio, KL, loss,
    grad norm) get none."""
    require: tuple[str, ...] = ()
    """Branches the reference must exercise before freeze accepts it (qualify.ppo.coverage.BRANCHES): policy_clip_high,
    policy_clip_low, policy_clip_dual, value_clip, grad_clip, kl, padded_rows, adam_past_first_step."""

    def __post_init__(self) -> None:
        from qualify.ppo.coverage import BRANCHES

        _finite(self)
        _distinct("freeze.require", self.require, nonempty=False)
        unknown_branches = sorted(set(self.require) - set(BRANCHES))
        if unknown_branches:
            raise ValueError(f"freeze.require names unknown branches {unknown_branches} "
                             f"(known: {', '.join(BRANCHES)})")
        if "moment" in self.floors:
            raise ValueError("freeze.floors.moment: AdamW's moments are no longer judged against a bound (they are "
                             "derived from the case's own gradients, qualify.candidate.derived); remove it")
        unknown = sorted(set(self.floors) - set(METRIC_KINDS))
        if unknown:
            raise ValueError(f"unknown floor kinds {unknown} (allowed: {', '.join(METRIC_KINDS)})")
        missing = sorted(set(METRIC_KINDS) - set(self.floors))
        if missing:
            raise ValueError(f"floors missing for {missing}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.floor_ulps < 0:
            raise ValueError(f"floor_ulps must be >= 0, got {self.floor_ulps}")
        negative = sorted(kind for kind, floor in self.floors.items() if floor < 0)
        if negative:
            raise ValueError(f"floors must be >= 0: {', '.join(f'{k} {self.floors[k]}' for k in negative)}")


@dataclass(kw_only=True, slots=True, frozen=True)
class Candidates:
    """The candidate matrix: every combination of these runs as one case."""

    engines: tuple[str, ...]
    """Engine names from the registry, or 'module:factory' for a user's own engine."""
    precisions: tuple[Precision, ...] = PRECISIONS
    """Precisions."""
    tp: tuple[int, ...] = (1,)
    """Tensor-parallel degrees."""
    dp: tuple[int, ...] = (1,)
    """Data-parallel degrees: a case runs on tp x dp ranks, each DP rank holding a contiguous slice of every
    optimizer step's rows (which dp must divide); normalizers and group statistics are global, gradients summed."""
    max_ranks: int | None = None
    """Leave out the cases whose tp x dp exceeds this (2 on a 2-core machine keeps TP1xDP2 and TP2xDP1 and drops
    TP2xDP2); unset: every combination runs."""
    packing: tuple[Packing, ...] = ("padded",)
    """Batch layouts the cases train on: 'padded' (right-padded (B, T) rows) and 'packed' (remove-padding: each
    micro-batch's whole samples concatenated into one row, position ids restarting per sample, cu_seqlens;
    qualify.case.packing), judged against the same reference and bounds; a packed case is named ...-packed-<role>."""
    pack_tokens: int | None = None
    """Token budget of one packed micro-batch (prompt and response tokens of whole samples, greedy in row order):
    required when packing lists packed or reference.perturbations lists packed."""
    roles: tuple[Role, ...] = ("actor", "critic")
    """Roles."""
    topologies: tuple[Topology, ...] = ("dedicated",)
    """GPU topologies of the rounds job (the one that runs vLLM and a trainer together): dedicated = vLLM TP + trainer
    TP GPUs, shared = the larger of the two. Candidate jobs always ask for their case's tp x dp GPUs."""
    determinism: dict[str, str] = field(default_factory=dict)
    """Per engine (a name of engines), what it declares across its TP x DP cases: 'bitwise' (every tensor of a TP > 1
    or DP > 1 case must be bitwise its TP1/DP1 case's, or the case fails) or 'bounded' (the default: within the frozen
    bounds; the verdict still records each tensor's tier)."""
    layout_invariant: tuple[str, ...] = ()
    """Engines (names of engines) that declare their forward independent of the micro-batch layout: every case scores
    its step-0 rows one at a time, four at a time and in reverse order (qualify.candidate.layout_probe), and a token
    not bitwise the single batch's fails a declared engine's case; other engines' cases report it."""
    rollout_exact: tuple[str, ...] = ()
    """Engines (names of engines) that claim their step-0 logprobs, in the rollout's precision, are bitwise the
    logprobs the rollout sampled with (seed 002's exact tier; qualify.candidate.rollout_exact): a token that differs
    fails a declared engine's case in that precision; every other actor case reports the count."""
    vocab_tile: int | None = None
    """torch-tp's logprob path: unset, the logits are gathered whole and log_softmax'd in chunks; a tile width, the
    deterministic vocab-parallel path (qualify.ppo.vocab_parallel: fixed-order merge of per-tile (max, sum-exp)
    partials, bitwise the same for every TP split). Each TP degree x vocab_tile must divide the vocabulary."""
    logprob_formula: LogprobFormula = "full"
    """The formula of the logprobs the engines report (outputs/logprobs_BT), judged against the reference's formula of
    that name: 'full' (log_softmax over the whole vocabulary: what trainers compute) or 'processed' (vLLM's, renormalized
    over the tokens rollout.top_k/top_p/min_p keep). The loss, ratio and KL are built from the full formula either
    way, against the rollout's processed logprobs as old logprobs."""
    waive: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per engine (a name of engines), the checks it is excused from where they cannot be made, by name
    (qualify.waivers.WAIVABLE: 'sampler_derivation', for an engine without a logits() hook). Per engine, as the other
    declarations here: a waiver excuses the engine it names and no other. A waived row passes and every report names
    the waiver beside the verdict; without the waiver the row fails."""

    def __post_init__(self) -> None:
        for name in ("engines", "precisions", "tp", "dp", "packing", "roles", "topologies"):
            _distinct(name, getattr(self, name))
        for engine in self.engines:
            problem = engine_name_problem(engine)
            if problem:
                raise ValueError(f"engines: {problem}")
        if any(tp < 1 for tp in self.tp):
            raise ValueError(f"tp must list degrees >= 1, got {list(self.tp)}")
        if any(dp < 1 for dp in self.dp):
            raise ValueError(f"dp must list degrees >= 1, got {list(self.dp)}")
        if self.vocab_tile is not None and self.vocab_tile < 1:
            raise ValueError(f"vocab_tile must be >= 1 or null, got {self.vocab_tile}")
        if self.vocab_tile is not None and self.logprob_formula != "full":
            raise ValueError("vocab_tile (the vocab-parallel logprob path) computes the full formula only: "
                             f"logprob_formula is {self.logprob_formula!r}")
        undeclared = sorted(set(self.layout_invariant) - set(self.engines))
        if undeclared:
            raise ValueError(f"layout_invariant names {undeclared}, which are not among engines {list(self.engines)}")
        undeclared = sorted(set(self.rollout_exact) - set(self.engines))
        if undeclared:
            raise ValueError(f"rollout_exact names {undeclared}, which are not among engines {list(self.engines)}")
        unknown = sorted(set(self.determinism) - set(self.engines))
        if unknown:
            raise ValueError(f"determinism names {unknown}, which are not among engines {list(self.engines)}")
        bad = sorted(f"{e}: {v!r}" for e, v in self.determinism.items() if v not in ("bitwise", "bounded"))
        if bad:
            raise ValueError(f"determinism must be 'bitwise' or 'bounded' per engine, got {', '.join(bad)}")
        self.check_waivers()
        self.check_packing()
        if self.max_ranks is not None and self.max_ranks < min(self.tp) * min(self.dp):
            raise ValueError(f"max_ranks {self.max_ranks} leaves no case (the smallest is tp {min(self.tp)} x dp "
                             f"{min(self.dp)})")


    def check_packing(self) -> None:
        """pack_tokens is a positive budget; packed cases are refused for the built-in engines that cannot take them."""
        if self.pack_tokens is not None and self.pack_tokens < 1:
            raise ValueError(f"pack_tokens must be >= 1 or null, got {self.pack_tokens}")
        if "packed" in self.packing and self.pack_tokens is None:
            raise ValueError("packing lists packed: pack_tokens (the token budget of a packed micro-batch) is required")
        for engine in self.engines if "packed" in self.packing else ():
            if engine in UNPACKED_ENGINES:
                raise ValueError(f"packing lists packed, which engine {engine} cannot take: {UNPACKED_ENGINES[engine]}; "
                                 "give it a matrix with packing [padded]")

    def check_waivers(self) -> None:
        """waive names engines of engines, and waivable checks (qualify.waivers.WAIVABLE), each once per engine."""
        unknown = sorted(set(self.waive) - set(self.engines))
        if unknown:
            raise ValueError(f"waive names {unknown}, which are not among engines {list(self.engines)}")
        for engine, checks in self.waive.items():
            _distinct(f"waive.{engine}", checks)
            bad = unknown_checks(checks)
            if bad:
                raise ValueError(f"waive.{engine}: unknown check(s) {bad} (checks that can be waived: "
                                 f"{', '.join(WAIVABLE)})")


ROUNDS_PROBES = ("stale", "wrong-shard", "missing-ack", "duplicate-ack", "warm-cache")
MIN_ROUNDS = 2
"""The fewest rounds a rounds run has: an install needs a round after it."""
"""The rejection probes of a rounds run (qualify.rounds.probes implements each)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Rounds:
    """The rounds run (`qualify rounds`): live actor-weight installation into vLLM, and its rejection probes."""

    engine: str = "torch-tp"
    """Candidate engine that trains the actor between rounds (a registry name or 'package.module:factory')."""
    rounds: int = 2
    """Rounds (round 0 trains with the reference rollout; the last round only rolls out); >= 2."""
    vllm_tp: int | None = None
    """vLLM TP degree of the rollout engine (default: the first of rollout.vllm_tp)."""
    train_tp: int = 1
    """TP degree of the training step."""
    train_precision: Precision = "fp32"
    """Precision of the training step: fp32, or bf16 (bf16 compute, FP32 master weights and updates). An engine that
    claims seed 002's exact tier (candidates.rollout_exact) makes the claim in the rollout's precision: train in
    rollout.dtype for its row after each weight sync to be judged rather than reported."""
    probes: tuple[str, ...] = ROUNDS_PROBES
    """Rejection probes to run (empty: none)."""

    def __post_init__(self) -> None:
        problem = engine_name_problem(self.engine)
        if problem:
            raise ValueError(f"engine: {problem}")
        if self.rounds < MIN_ROUNDS:
            raise ValueError(f"rounds must be >= {MIN_ROUNDS} (an install needs a round after it), got {self.rounds}")
        if self.train_tp < 1 or (self.vllm_tp is not None and self.vllm_tp < 1):
            raise ValueError("vllm_tp and train_tp must be >= 1")
        if self.train_precision not in PRECISIONS:
            raise ValueError(f"train_precision: {self.train_precision!r} is not one of {', '.join(PRECISIONS)}")
        _distinct("probes", self.probes, nonempty=False)
        unknown = sorted(set(self.probes) - set(ROUNDS_PROBES))
        if unknown:
            raise ValueError(f"probes: unknown {unknown} (known: {', '.join(ROUNDS_PROBES)})")


@dataclass(kw_only=True, slots=True, frozen=True)
class Case:
    """One candidate case."""

    engine: str
    precision: Precision
    tp: int
    role: Role
    dp: int = 1
    packing: Packing = "padded"

    @property
    def name(self) -> str:
        """engine-precision-tp<N>[-dp<M>][-packed]-role: the DP degree appears only above 1 and the packing only when
        packed, so DP1 padded names stay as they were."""
        safe = self.engine.replace(":", "-").replace(".", "-")
        dp = f"-dp{self.dp}" if self.dp > 1 else ""
        packed = "-packed" if self.packing == "packed" else ""
        return f"{safe}-{self.precision}-tp{self.tp}{dp}{packed}-{self.role}"

    @property
    def world_size(self) -> int:
        """Ranks of the case's launch: tp x dp."""
        return self.tp * self.dp


@dataclass(kw_only=True, slots=True, frozen=True)
class Objective:
    """What one training step computes: the algorithm with its PPO and GRPO settings, and AdamW. The reference's step,
    the decisions, the loss terms and the judge's derivations read this section of the matrix, never the whole of it
    (Matrix.objective makes it)."""

    algorithm: Algorithm
    ppo: PPO
    grpo: GRPO | None
    optimizer: Optimizer

    @property
    def roles(self) -> tuple[Role, ...]:
        """The trained roles: actor and critic under ppo, the actor alone under grpo."""
        return ("actor",) if self.algorithm == "grpo" else ("actor", "critic")


@dataclass(kw_only=True, slots=True, frozen=True)
class CaseSettings:
    """What a case's ranks are told of the matrix (qualify.case.spec.make_spec): the objective, the rollout's
    sampling settings, the reference's logprob chunking and device, and the candidates section (logprob formula,
    determinism, vocabulary tiles, layout invariance). Matrix.case_settings makes it."""

    objective: Objective
    rollout: Rollout
    reference: Reference
    candidates: Candidates


@dataclass(kw_only=True, slots=True, frozen=True)
class Capture:
    """What sampling the rollout reads: the rollout section, the responses per prompt (GRPO's group size, else 1) and
    the prompts file resolved against the matrix file's directory (Matrix.capture makes it)."""

    rollout: Rollout
    group_size: int = 1
    prompts_file: Path | None = None


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
    algorithm: Algorithm = "ppo"
    """ppo (actor and critic, GAE advantages) or grpo (group-relative advantages, no critic; needs the grpo section)."""
    ppo: PPO = field(default_factory=PPO)
    """PPO settings (under grpo only the policy clip, entropy_coef, epochs and minibatches are used)."""
    grpo: GRPO | None = None
    """GRPO settings: required with algorithm grpo, refused otherwise."""
    optimizer: Optimizer = field(default_factory=Optimizer)
    """AdamW settings."""
    reference: Reference = field(default_factory=Reference)
    """Reference and controls."""
    freeze: Freeze
    """Bound rule."""
    candidates: Candidates
    """Candidate matrix."""
    rounds: Rounds = field(default_factory=Rounds)
    """The rounds run."""
    source: str = ""
    """Path of the YAML file (set by the loader)."""

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"name {self.name!r} must be 1-100 ASCII letters, digits, '.', '_' or '-', starting "
                             "with a letter or digit (it names the run directory and the Slurm jobs)")
        if not self.description.isprintable():
            raise ValueError("description must be one line of printable text")
        if set(self.reference.precisions) != set(PRECISIONS):
            raise ValueError("reference.precisions must be [fp32, bf16]: the bound families need both")
        self._check_algorithm()
        self._check_required_branches()
        self._check_packing()
        if self.ppo.entropy_coef > 0 and self.candidates.vocab_tile is not None:
            raise ValueError(f"ppo.entropy_coef {self.ppo.entropy_coef} with candidates.vocab_tile "
                             f"{self.candidates.vocab_tile}: the vocab-parallel logprob path computes no entropy; "
                             "unset vocab_tile or entropy_coef")
        if self.algorithm == "ppo" and self.rollout.num_prompts % self.ppo.minibatches:
            raise ValueError(f"ppo.minibatches {self.ppo.minibatches} does not divide rollout.num_prompts "
                             f"{self.rollout.num_prompts} (every minibatch has the same rows; none is dropped)")
        step_rows = self.num_rows // self.ppo.minibatches
        for dp in self.candidates.dp:
            if step_rows % dp:
                raise ValueError(f"candidates.dp {dp} does not divide the {step_rows} rows of an optimizer step "
                                 f"({self.num_rows} rows / ppo.minibatches {self.ppo.minibatches}): each DP rank "
                                 "holds an equal, contiguous slice and no row is dropped")
        if self.models.tiny is not None:
            t = self.models.tiny
            if (t.moe is None) != (self.rollout.routing is None):
                raise ValueError("rollout.routing (replay or recompute) is required for a MoE family (models.tiny.moe) "
                                 "and refused for a dense one")
            megatron = [e for e in self.candidates.engines if e in MEGATRON_ENGINES]
            if t.moe is not None and megatron and max(self.candidates.tp) > 1:
                raise ValueError(f"candidates.engines lists {megatron[0]} beside the MoE family of models.tiny.moe "
                                 f"with candidates.tp {list(self.candidates.tp)}: megatron runs a Qwen3-MoE model at "
                                 "TP 1 only (megatron-core trains MoE under TP with sequence parallelism alone, which "
                                 "the norms of its local spec refuse); give megatron a matrix of its own with tp [1]")
            self.check_family(t.num_heads, t.num_kv_heads, t.intermediate_size, t.vocab_size, "models.tiny")
            if self.rollout.max_model_len > t.max_position_embeddings:
                raise ValueError(f"rollout.max_model_len {self.rollout.max_model_len} exceeds "
                                 f"models.tiny.max_position_embeddings {t.max_position_embeddings}")

    def _check_required_branches(self) -> None:
        """freeze.require: refuse a branch that no reference of this matrix can take (freeze would refuse it after the
        whole reference ran), naming the setting that wakes it."""
        from qualify.ppo.coverage import BRANCHES

        steps = self.ppo.epochs * self.ppo.minibatches
        never = {"adam_past_first_step": steps < 2, "grad_clip": self.optimizer.max_grad_norm <= 0,
                 "padded_rows": self.rollout.max_new_tokens < 2, "policy_clip_dual": self.ppo.dual_clip_c is None}
        for branch in self.freeze.require:
            if never.get(branch):
                raise ValueError(f"freeze.require lists {branch}, which no reference of this matrix can exercise: "
                                 f"{BRANCHES[branch]}")

    def _check_packing(self) -> None:
        """Packed cases need the reference's packed control (what packing changes enters the bounds through it, never
        a wider tolerance); its budget is candidates.pack_tokens, which every sample must fit (samples are never
        split); a MoE family's routes are not replayed in the packed layout."""
        c, r = self.candidates, self.rollout
        packed_cases, packed_control = "packed" in c.packing, "packed" in self.reference.perturbations
        if packed_cases and not packed_control:
            raise ValueError("candidates.packing lists packed: reference.perturbations must list packed, the control "
                             "that samples what packing legitimately changes (attention shapes, micro-batching)")
        if packed_control and c.pack_tokens is None:
            raise ValueError("reference.perturbations lists packed: candidates.pack_tokens (the token budget of a "
                             "packed micro-batch) is required")
        longest = r.prompt_len + r.max_new_tokens
        if c.pack_tokens is not None and r.prompts_file is None and c.pack_tokens < longest:
            raise ValueError(f"candidates.pack_tokens {c.pack_tokens} is less than the longest sample, rollout.prompt_len "
                             f"{r.prompt_len} + max_new_tokens {r.max_new_tokens} = {longest} tokens (a sample is "
                             "never split)")
        if (packed_cases or packed_control) and r.routing is not None:
            raise ValueError("packed batches are not built for a MoE family (rollout.routing): its routes are "
                             "replayed in the padded layout only")

    def _check_algorithm(self) -> None:
        """GRPO: its section, no critic, whole groups in every minibatch, one seed per response."""
        if (self.algorithm == "grpo") != (self.grpo is not None):
            raise ValueError("the grpo section is required with algorithm: grpo and refused otherwise "
                             f"(algorithm is {self.algorithm!r})")
        if self.algorithm != "grpo":
            return
        if "critic" in self.candidates.roles:
            raise ValueError("candidates.roles lists critic, but GRPO has no critic: write roles: [actor]")
        if "value_clip" in self.freeze.require:
            raise ValueError("freeze.require lists value_clip, but GRPO has no critic (no value loss to clip)")
        rows, g = self.num_rows, self.grpo.group_size
        if rows % self.ppo.minibatches or (rows // self.ppo.minibatches) % g:
            raise ValueError(f"ppo.minibatches {self.ppo.minibatches} must split the {rows} rows (rollout.num_prompts "
                             f"{self.rollout.num_prompts} x grpo.group_size {g}) into equal minibatches of whole "
                             "groups")
        if self.rollout.seed + rows - 1 > MAX_SEED:
            raise ValueError("rollout.seed + rows - 1 must be <= 2^63 - 1 (response i samples with seed + i)")

    @property
    def num_rows(self) -> int:
        """Sequences in the batch: one per prompt under ppo, grpo.group_size per prompt under grpo."""
        return self.rollout.num_prompts * (self.grpo.group_size if self.grpo is not None else 1)

    @property
    def objective(self) -> Objective:
        """The objective's sections (algorithm, ppo, grpo, optimizer): what a step computes."""
        return Objective(algorithm=self.algorithm, ppo=self.ppo, grpo=self.grpo, optimizer=self.optimizer)

    @property
    def case_settings(self) -> CaseSettings:
        """The sections a case's spec is made from."""
        return CaseSettings(objective=self.objective, rollout=self.rollout, reference=self.reference,
                            candidates=self.candidates)

    @property
    def capture(self) -> Capture:
        """The rollout's sampling: its section, GRPO's group size and the resolved prompts file."""
        r = self.rollout
        return Capture(rollout=r, group_size=self.grpo.group_size if self.grpo is not None else 1,
                       prompts_file=None if r.prompts_file is None else self.resolve(r.prompts_file))

    @property
    def roles(self) -> tuple[Role, ...]:
        """The trained roles the reference scores: actor and critic under ppo, the actor alone under grpo."""
        return self.objective.roles

    def cases(self) -> list[Case]:
        """Every case of the candidate matrix, in a stable order (DP degrees after TP's, DP1 first; each layout of
        candidates.packing after the DP degree, in its order)."""
        c = self.candidates
        return [Case(engine=e, precision=p, tp=t, role=r, dp=d, packing=k)
                for e, p, t, d, k, r in itertools.product(c.engines, c.precisions, c.tp, c.dp, c.packing, c.roles)
                if c.max_ranks is None or t * d <= c.max_ranks]

    def resolve(self, path: str) -> Path:
        """A path from the matrix, relative to the matrix file's directory."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else (Path(self.source).parent / p)

    def check_family(self, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                     where: str) -> None:
        """Every TP degree (candidates.tp, rollout.vllm_tp) shards the heads and the MLP evenly; EOS is in the vocab."""
        degrees = [("candidates.tp", tp) for tp in self.candidates.tp] + [("rollout.vllm_tp", tp)
                                                                             for tp in self.rollout.vllm_tp]
        degrees += [("rounds.train_tp", self.rounds.train_tp)] + (
            [("rounds.vllm_tp", self.rounds.vllm_tp)] if self.rounds.vllm_tp is not None else [])
        for key, tp in degrees:
            for name, size in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                               ("intermediate_size", intermediate_size)):
                if size % tp:
                    raise ValueError(f"{key} {tp} does not divide {where}.{name} {size} "
                                     f"(every TP degree must divide num_heads, num_kv_heads and intermediate_size)")
        tile = self.candidates.vocab_tile
        for tp in self.candidates.tp if tile is not None else ():
            if vocab_size % (tp * tile):
                raise ValueError(f"candidates.vocab_tile {tile} x candidates.tp {tp} does not divide {where} "
                                 f"vocab_size {vocab_size} (every TP rank holds whole tiles of the vocabulary)")
        eos = self.rollout.eos_token_id
        if eos is not None and eos >= vocab_size:
            raise ValueError(f"rollout.eos_token_id {eos} is not in the vocabulary (must be < {where} vocab_size "
                             f"{vocab_size})")

    def check_checkpoint_family(self) -> None:
        """For checkpoint models, check the TP degrees and EOS against the actor's config.json when it is there.

        A missing directory is not an error here (the matrix may be written before the checkpoints are copied):
        the reference stage reports it when it needs the files.
        """
        config_path = self.resolve(self.models.checkpoints.actor) / "config.json"
        if not config_path.is_file():
            return
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise MatrixError(f"{self.source}: models.checkpoints.actor: cannot read {config_path}: "
                              f"{type(exc).__name__}") from exc
        keys = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
        values = [config.get(k) if isinstance(config, dict) else None for k in keys]
        if not all(type(v) is int and v > 0 for v in values):
            raise MatrixError(f"{self.source}: models.checkpoints.actor: {config_path} lacks positive integers "
                              f"{', '.join(keys)}")
        try:
            self.check_family(*values, "models.checkpoints.actor config.json")
        except ValueError as exc:
            raise MatrixError(f"{self.source}: {exc}") from exc

    def missing_here(self) -> list[str]:
        """What the matrix names that is not on this machine (checkpoint directories without config.json, the prompts
        file): the reference stage would stop on each."""
        out = []
        if self.models.checkpoints is not None:
            for role in ("actor", "reference", "critic", "reward"):
                where = getattr(self.models.checkpoints, role)
                if not (self.resolve(where) / "config.json").is_file():
                    out.append(f"models.checkpoints.{role} {where} (no config.json there)")
        if self.rollout.prompts_file is not None and not self.resolve(self.rollout.prompts_file).is_file():
            out.append(f"rollout.prompts_file {self.rollout.prompts_file} (not a file)")
        return out


def load_matrix(path: Path | str) -> Matrix:
    """Read and validate a matrix YAML file (for checkpoint models, against the actor's config.json too)."""
    matrix = load_yaml_file(Matrix, path, "matrix file", {"source": str(path)})
    if matrix.models.checkpoints is not None:
        matrix.check_checkpoint_family()
    return matrix


def matrix_files(directory: Path) -> list[Path]:
    """Matrix files in a directory."""
    return sorted(p for p in Path(directory).glob("*.yaml"))
