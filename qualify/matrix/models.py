"""The models section: a tiny Qwen3 family made from a seed, or the checkpoint directories of a real one."""

from __future__ import annotations

from dataclasses import dataclass

from qualify.matrix.values import at_least, at_most_tiny, finite, positive, seed_in_range


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
        at_least(self, 2, "num_experts")
        at_least(self, 1, "top_k", "moe_intermediate_size")
        at_most_tiny(self, "num_experts", "moe_intermediate_size")
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
        finite(self)
        seed_in_range("seed", self.seed)
        at_least(self, 1, "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "max_position_embeddings")
        at_most_tiny(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim", "max_position_embeddings")
        positive(self, "initializer_range", "rope_theta")
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
