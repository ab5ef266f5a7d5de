"""HF Qwen3 and Qwen3-MoE <-> megatron-core GPTModel (local layer spec) tensor-parallel shards, both ways.

Pure tensor code, no megatron import: the same functions convert parameters, gradients and
optimizer moments, since all of them have the parameters' shapes. Megatron's layouts:
- linear_qkv rows are grouped by KV head: for each query group g, its q heads, then k_g, then v_g;
  TP rank r holds the r-th of tp equal row slices of that, i.e. groups [r * G/tp, (r + 1) * G/tp)
  when tp divides G, and a part of one group when G divides tp (Megatron then all-gathers qkv).
- linear_fc1 on rank r is [gate rows of r; up rows of r] (swiglu chunks the local output in two).
- linear_proj and linear_fc2 split the input dimension; norms and the critic's value head are
  replicated on every rank.
- vocab-sized matrices (embedding, output layer) get zero rows up to a multiple of
  vocab_divisible_by x tp, then split by rows.
- a Qwen3-MoE layer (every layer sparse): the router (HF mlp.gate, Megatron mlp.router) is replicated; expert e is
  mlp.experts.local_experts.<e>, an MLP sharded over TP like the dense one (Megatron's expert TP = TP, no expert
  parallelism): linear_fc1 per rank [gate rows of r; up rows of r], linear_fc2 split by its input. transformers 5
  holds each layer's experts fused (experts.gate_up_proj (E, 2I, H): gate rows then up rows; experts.down_proj
  (E, H, I)); the plan names each expert's own projections (the checkpoint's names, exact slices of the fused ones)
  and hf_to_megatron / megatron_to_hf unfuse and fuse at the edges, so the HF side is the model's parameters.
Megatron modules carry `_extra_state` entries (None for local layers, serialized bytes for
TransformerEngine's FP8 metadata). They are not parameters: megatron_to_hf skips them with a note
and refuses one that holds a real (floating) tensor.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qualify.errors import EngineError
from qualify.roles import ROLES

EXTRA_STATE = "_extra_state"


@dataclass(frozen=True, slots=True)
class Qwen3Layout:
    """The shape facts conversion needs, from an HF Qwen3 config."""

    role: str
    """'actor' (Qwen3ForCausalLM) or 'critic' (Qwen3ForTokenClassification, num_labels=1)."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    """Real vocabulary size (rows of the HF embedding)."""
    tie_word_embeddings: bool
    """Actor only: lm_head shares the embedding (HF then stores no lm_head.weight)."""
    value_bias: bool = True
    """Critic only: whether score has a bias (transformers' token_classification_bias, default True)."""
    vocab_divisible_by: int = 128
    """Megatron's make_vocab_size_divisible_by; the padded vocab is a multiple of this x tp."""
    num_experts: int = 0
    """Qwen3-MoE: experts of every (sparse) layer; 0 for a dense Qwen3."""
    moe_top_k: int = 0
    """Qwen3-MoE: experts each token is routed to (num_experts_per_tok)."""
    moe_intermediate_size: int = 0
    """Qwen3-MoE: each expert's intermediate size."""
    norm_topk_prob: bool = True
    """Qwen3-MoE: the top-k routing weights are renormalized to sum to 1."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise EngineError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.num_experts and not 0 < self.moe_top_k <= self.num_experts:
            raise EngineError(f"moe_top_k {self.moe_top_k} must be in 1..num_experts {self.num_experts}")

    @classmethod
    def from_hf_config(cls, config: Any, role: str, vocab_divisible_by: int = 128) -> Qwen3Layout:
        """Read a transformers Qwen3Config (or anything with the same attributes)."""
        if role == "critic" and getattr(config, "num_labels", 1) != 1:
            raise EngineError(f"critic needs num_labels=1, the config has {config.num_labels}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(role=role, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                   num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                   head_dim=head_dim, intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
                   tie_word_embeddings=role == "actor" and bool(config.tie_word_embeddings),
                   value_bias=bool(getattr(config, "token_classification_bias", True)),
                   vocab_divisible_by=vocab_divisible_by, **moe_fields(config))

    def padded_vocab(self, tp: int) -> int:
        """Megatron's vocab size with padding: the next multiple of vocab_divisible_by x tp."""
        multiple = self.vocab_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def check_tp(self, tp: int) -> None:
        """Refuse a TP degree Megatron cannot shard this model to."""
        if self.num_heads % self.num_kv_heads:
            raise EngineError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        counts = [("num_heads", self.num_heads), ("intermediate_size", self.intermediate_size)]
        if self.num_experts:
            counts.append(("moe_intermediate_size", self.moe_intermediate_size))
        for what, count in counts:
            if tp < 1 or count % tp:
                raise EngineError(f"tp {tp} does not divide {what} {count}: Megatron cannot shard this model")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise EngineError(f"tp {tp} is neither a divisor nor a multiple of num_kv_heads {self.num_kv_heads} "
                              "(Megatron's num_query_groups rule)")

    def vocab_rows(self, tp: int, rank: int) -> tuple[int, int]:
        """(start, stop) rows of the padded vocab held by rank."""
        per_rank = self.padded_vocab(tp) // tp
        return rank * per_rank, (rank + 1) * per_rank


def moe_fields(config: Any) -> dict[str, Any]:
    """Qwen3Layout's MoE fields of an HF config ({} for a dense Qwen3); refuses a Qwen3-MoE with dense layers (the
    conversion and the engine make every layer sparse)."""
    if getattr(config, "model_type", "qwen3") != "qwen3_moe":
        return {}
    if list(getattr(config, "mlp_only_layers", None) or []) or getattr(config, "decoder_sparse_step", 1) != 1:
        raise EngineError(f"the megatron engine converts a Qwen3-MoE whose every layer is sparse; this one has "
                          f"mlp_only_layers {config.mlp_only_layers} and decoder_sparse_step "
                          f"{config.decoder_sparse_step}")
    return {"num_experts": config.num_experts, "moe_top_k": config.num_experts_per_tok,
            "moe_intermediate_size": config.moe_intermediate_size, "norm_topk_prob": bool(config.norm_topk_prob)}


# A plan maps each Megatron name to (kind, HF names); kinds: vocab, qkv, fc1, row, replicated.
Plan = dict[str, tuple[str, tuple[str, ...]]]


def conversion_plan(layout: Qwen3Layout) -> Plan:
    """Every Megatron parameter name with its conversion kind and the HF names it comes from."""
    plan: Plan = {"embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",))}
    for i in range(layout.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = h + "self_attn."
        plan[m + "input_layernorm.weight"] = ("replicated", (h + "input_layernorm.weight",))
        plan[m + "self_attention.linear_qkv.weight"] = (
            "qkv", (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"))
        plan[m + "self_attention.q_layernorm.weight"] = ("replicated", (attn + "q_norm.weight",))
        plan[m + "self_attention.k_layernorm.weight"] = ("replicated", (attn + "k_norm.weight",))
        plan[m + "self_attention.linear_proj.weight"] = ("row", (attn + "o_proj.weight",))
        plan[m + "pre_mlp_layernorm.weight"] = ("replicated", (h + "post_attention_layernorm.weight",))
        if layout.num_experts:
            plan[m + "mlp.router.weight"] = ("replicated", (h + "mlp.gate.weight",))
            for e in range(layout.num_experts):
                x, y = f"{m}mlp.experts.local_experts.{e}.", f"{h}mlp.experts.{e}."
                plan[x + "linear_fc1.weight"] = ("fc1", (y + "gate_proj.weight", y + "up_proj.weight"))
                plan[x + "linear_fc2.weight"] = ("row", (y + "down_proj.weight",))
            continue
        plan[m + "mlp.linear_fc1.weight"] = ("fc1", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"))
        plan[m + "mlp.linear_fc2.weight"] = ("row", (h + "mlp.down_proj.weight",))
    plan["decoder.final_layernorm.weight"] = ("replicated", ("model.norm.weight",))
    if layout.role == "actor":
        if not layout.tie_word_embeddings:
            plan["output_layer.weight"] = ("vocab", ("lm_head.weight",))
    else:
        plan["output_layer.weight"] = ("replicated", ("score.weight",))
        if layout.value_bias:
            plan["output_layer.bias"] = ("replicated", ("score.bias",))
    return plan


_EXPERT = re.compile(r"(?P<prefix>.+\.mlp\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")


def param_name(name: str) -> str:
    """The model parameter an HF name of the plan belongs to: an expert's own projection (experts.<e>.gate_proj
    .weight) is a slice of its layer's fused experts.gate_up_proj or experts.down_proj; any other name is itself."""
    m = _EXPERT.fullmatch(name)
    if m is None:
        return name
    return f"{m['prefix']}.{'down_proj' if m['proj'] == 'down_proj' else 'gate_up_proj'}"


def hf_names(layout: Qwen3Layout) -> list[str]:
    """Every HF parameter name conversion expects and gives back (fused experts for a Qwen3-MoE), in plan order."""
    names = [param_name(name) for _, names in conversion_plan(layout).values() for name in names]
    return list(dict.fromkeys(names))


def unfuse_experts(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """hf with each fused experts.gate_up_proj (E, 2I, H) and experts.down_proj (E, H, I) replaced by every expert's
    own gate_proj, up_proj and down_proj (views, exact); other tensors as they are."""
    out = {}
    for name, t in hf.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for e, (gate, up) in enumerate(x.chunk(2, dim=0) for x in t):
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            out.update({f"{prefix}.{e}.down_proj.weight": x for e, x in enumerate(t)})
        else:
            out[name] = t
    return out


def fuse_experts(per_expert: Mapping[str, torch.Tensor], layout: Qwen3Layout) -> dict[str, torch.Tensor]:
    """unfuse_experts' inverse, in hf_names order: every expert's projections stacked into its layer's fused
    gate_up_proj ([gate; up] per expert) and down_proj."""
    out = {}
    for name in hf_names(layout):
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            out[name] = torch.stack([torch.cat([per_expert[f"{prefix}.{e}.gate_proj.weight"],
                                                per_expert[f"{prefix}.{e}.up_proj.weight"]])
                                     for e in range(layout.num_experts)])
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            out[name] = torch.stack([per_expert[f"{prefix}.{e}.down_proj.weight"] for e in range(layout.num_experts)])
        else:
            out[name] = per_expert[name]
    return out


def _check_keys(given: Sequence[str], expected: Sequence[str], what: str) -> None:
    given_set = set(given)
    missing = [k for k in expected if k not in given_set]
    unknown = sorted(set(given) - set(expected))
    if missing or unknown:
        parts = [f"missing {_some(missing)}" if missing else "", f"unknown {_some(unknown)}" if unknown else ""]
        raise EngineError(f"{what}: " + "; ".join(p for p in parts if p))


def _some(names: Sequence[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: Qwen3Layout, tp: int) -> list[dict[str, torch.Tensor]]:
    """Split an HF Qwen3 state dict into tp Megatron shards (one dict per rank), dtypes kept."""
    layout.check_tp(tp)
    hf = dict(hf)
    if layout.tie_word_embeddings and "lm_head.weight" in hf:
        # A tied model's state_dict() lists the shared tensor twice; save_pretrained stores it once.
        if not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
            raise EngineError("tie_word_embeddings is set but lm_head.weight differs from model.embed_tokens.weight")
        del hf["lm_head.weight"]
    plan = conversion_plan(layout)
    _check_keys(list(hf), hf_names(layout), f"HF {layout.role} checkpoint")
    hf = unfuse_experts(hf)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for mname, (kind, names) in plan.items():
        pieces = _split(kind, [hf[n] for n in names], layout, tp)
        for rank in range(tp):
            shards[rank][mname] = pieces[rank]
    return shards


def _split(kind: str, ts: list[torch.Tensor], layout: Qwen3Layout, tp: int) -> list[torch.Tensor]:
    if kind == "replicated":
        return [ts[0].contiguous() for _ in range(tp)]
    if kind == "row":
        return [c.contiguous() for c in ts[0].chunk(tp, dim=1)]
    if kind == "vocab":
        (w,) = ts
        pad = w.new_zeros((layout.padded_vocab(tp) - w.shape[0], *w.shape[1:]))
        return [c.contiguous() for c in torch.cat([w, pad]).chunk(tp, dim=0)]
    if kind == "fc1":
        gate, up = (t.chunk(tp, dim=0) for t in ts)
        return [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
    assert kind == "qkv", kind
    q, k, v = ts
    groups = layout.num_kv_heads
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                        dim=1)  # (G, (heads_per_group + 2) * head_dim, H)
    return [c.contiguous() for c in grouped.reshape(-1, *rest).chunk(tp, dim=0)]


def megatron_to_hf(shards: Sequence[Mapping[str, Any]], layout: Qwen3Layout,
                   notes: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Merge tp Megatron shards (params, grads or moments) into full HF tensors, padding rows dropped.

    Replicated tensors are taken from rank 0 (replica agreement is checked as its own evidence).
    `_extra_state` entries are skipped and named in notes; any other unknown or missing key is an error.
    """
    tp = len(shards)
    layout.check_tp(tp)
    plan = conversion_plan(layout)
    clean = [drop_extra_state(shard, rank, notes) for rank, shard in enumerate(shards)]
    for rank, shard in enumerate(clean):
        _check_keys(list(shard), list(plan), f"Megatron shard of rank {rank}/{tp}")
    out: dict[str, torch.Tensor] = {}
    for mname, (kind, names) in plan.items():
        parts = [shard[mname] for shard in clean]
        _check_local_shapes(mname, parts, kind, layout)
        for name, full in zip(names, _merge(kind, parts, layout), strict=True):
            out[name] = full
    return fuse_experts(out, layout)


def drop_extra_state(shard: Mapping[str, Any], rank: int, notes: list[str] | None) -> dict[str, Any]:
    """shard without its `_extra_state` entries; refuses one that holds a floating-point tensor."""
    kept, skipped = {}, []
    for key, value in shard.items():
        if key.rsplit(".", 1)[-1] != EXTRA_STATE:
            kept[key] = value
            continue
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            raise EngineError(f"{key} on rank {rank} holds a {value.dtype} tensor {tuple(value.shape)}: "
                              "not module metadata; refusing to drop it")
        if value is not None and not isinstance(value, (torch.Tensor, io.BytesIO, bytes)):
            raise EngineError(f"{key} on rank {rank} holds a {type(value).__name__}: not module metadata")
        skipped.append(key)
    if skipped and notes is not None:
        notes.append(f"rank {rank}: skipped {len(skipped)} _extra_state entries (module metadata, not "
                     f"parameters): {_some(skipped, 3)}")
    return kept


def _check_local_shapes(mname: str, parts: list[torch.Tensor], kind: str, layout: Qwen3Layout) -> None:
    tp = len(parts)
    h, hd = layout.hidden_size, layout.head_dim
    ffn = layout.moe_intermediate_size if ".mlp.experts." in mname else layout.intermediate_size
    qkv_rows = (layout.num_heads + 2 * layout.num_kv_heads) * hd
    if kind == "vocab":
        want = (layout.padded_vocab(tp) // tp, h)
    elif kind == "qkv":
        want = (qkv_rows // tp, h)
    elif kind == "fc1":
        want = (2 * ffn // tp, h)
    elif kind == "row":
        want = (h, (layout.num_heads * hd if "linear_proj" in mname else ffn) // tp)
    else:
        want = tuple(parts[0].shape)
    for rank, t in enumerate(parts):
        if tuple(t.shape) != want:
            raise EngineError(f"{mname} on rank {rank}/{tp} has shape {tuple(t.shape)}, expected {want}")


def _merge(kind: str, parts: list[torch.Tensor], layout: Qwen3Layout) -> list[torch.Tensor]:
    if kind == "replicated":
        return [parts[0].contiguous()]
    if kind == "row":
        return [torch.cat(parts, dim=1)]
    if kind == "vocab":
        return [torch.cat(parts)[: layout.vocab_size].contiguous()]
    if kind == "fc1":
        halves = [p.chunk(2, dim=0) for p in parts]
        return [torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])]
    assert kind == "qkv", kind
    rest = parts[0].shape[1:]
    per_group = layout.num_heads // layout.num_kv_heads * layout.head_dim
    grouped = torch.cat(parts).reshape(layout.num_kv_heads, per_group + 2 * layout.head_dim, *rest)
    q, k, v = grouped.split([per_group, layout.head_dim, layout.head_dim], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def padded_rows(shard: Mapping[str, torch.Tensor], layout: Qwen3Layout, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's rows of vocab-sized tensors beyond the real vocab, keyed by HF name (may be empty)."""
    start, stop = layout.vocab_rows(tp, rank)
    first_pad = max(layout.vocab_size, start) - start
    out = {}
    for mname, (kind, names) in conversion_plan(layout).items():
        if kind == "vocab" and first_pad < stop - start:
            out[names[0]] = shard[mname][first_pad:]
    return out
