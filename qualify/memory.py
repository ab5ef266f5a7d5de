"""What each stage needs in GPU and host memory, from a matrix's model shape, precisions, TP and reference settings.

`qualify sbatch` checks these needs against a cluster profile's GPU memory at render time, so a stage that cannot
fit is refused with its numbers before it queues, not killed by the allocator hours in. The model is bytes per
parameter of what a stage holds (FP32 master, gradients, AdamW moments, compute copy, the step's evidence) plus an
activation estimate; benchmarks/LOG.md ("GPU scale") compares it with peaks measured at the Qwen3-0.6B shape.

Bytes per parameter (P = parameters of the role's model, K = optimizer steps per case):

    reference, on the device:  fp32: master 4 + grad 4 + AdamW 8 + the step's `before` copy 4 = 20
                               bf16: the same 20 + the bf16 copy 2 + its gradient 2 = 24
    reference, offload: host:  device: the compute copy and its gradient (fp32 4 + 4 = 8, bf16 2 + 2 = 4);
                               host: master, grad, AdamW, `before` (20)
    reference host, always:    the evidence of K steps (grads 4, updates 4, both moments 8: 16 K), plus the
                               checkpoint loaded in fp32 (4) when the master goes to the device
    candidate, per GPU:        fp32 16 (master, grad, AdamW), bf16 20 (+ bf16 copy and gradient), times the
                               sharded parameters / TP plus the ones every rank holds whole (norms; the
                               embedding too, except in megatron, which shards it by vocabulary)

Activations (elements a token and layer keeps for backward, HF Qwen3 with SDPA): 5 h + 6 q + 4 kv + 5 i (h hidden,
q = heads x head_dim, kv = kv_heads x head_dim, i = MLP width); with gradient checkpointing one layer input (h)
a layer plus one layer's full set. A Qwen3-MoE layer's MLP keeps top_k x (5 i_moe + 2 h) (each token's experts, its
input and output gathered per expert) and 2 x experts (the router's logits and probabilities); every rank holds the
router and experts whole (torch-tp's plan replicates them). The actor adds its logits and their gradient ([tokens, vocab] in the compute
precision, twice) and the chunked fp32 log_softmax (three [chunk, vocab] fp32 buffers). This is an estimate,
not an allocator trace: the figures it is checked against are in benchmarks/LOG.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualify.engines.catalog import VOCAB_SHARDING_ENGINES
from qualify.errors import SlurmError
from qualify.roles import ROLES

GiB = 1 << 30
CONTEXT_BYTES = 2 * GiB
"""Kept free on every GPU for the CUDA context, cuBLAS workspaces and NCCL buffers, beside the estimate."""
REFERENCE_STATE = {"fp32": 20, "bf16": 24}
OFFLOAD_DEVICE = {"fp32": 8, "bf16": 4}
OFFLOAD_HOST = 20
EVIDENCE_PER_STEP = 16
CANDIDATE_STATE = {"fp32": 16, "bf16": 20}
COMPUTE_BYTES = {"fp32": 4, "bf16": 2}
LOGPROB_CHUNK_BUFFERS = 3


@dataclass(frozen=True, slots=True)
class Shape:
    """The dimensions of one Qwen3 model that memory depends on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    lm_head: bool
    """A causal LM (actor): an LM head over the vocabulary; else one scalar head (critic)."""
    tied: bool = False
    """The LM head is the embedding (no parameters of its own)."""
    num_experts: int = 0
    """Experts of each MoE layer (Qwen3-MoE: every layer); 0 for a dense model."""
    top_k: int = 0
    """Experts each token runs through (num_experts_per_tok)."""
    moe_intermediate_size: int = 0
    """Each expert's MLP width."""

    @property
    def mlp_params(self) -> int:
        """One layer's MLP: gate, up and down projections (of every expert, and the router, in a MoE layer)."""
        h = self.hidden_size
        if self.num_experts:
            return self.num_experts * (3 * h * self.moe_intermediate_size + h)
        return 3 * h * self.intermediate_size

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return 2 * h * q + 2 * h * kv + self.mlp_params + 2 * h + 2 * self.head_dim

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        if not self.lm_head:
            return self.hidden_size + 1  # score weight and bias
        return 0 if self.tied else self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        """Every parameter (a tied head counted once, as named_parameters() lists it)."""
        return self.num_layers * self.layer_params + self.embed_params + self.head_params + self.hidden_size

    def replicated_params(self, engine: str) -> int:
        """Parameters every TP rank holds whole: the norms, a MoE layer's router and experts (torch-tp replicates
        them), and the embedding unless the engine shards it."""
        norms = self.num_layers * (2 * self.hidden_size + 2 * self.head_dim) + self.hidden_size
        embed = 0 if engine in VOCAB_SHARDING_ENGINES else self.embed_params
        experts = self.num_layers * self.mlp_params if self.num_experts else 0
        return norms + embed + experts + (0 if self.lm_head else self.head_params)

    def activation_elements(self, tokens: int, checkpointing: bool) -> int:
        """Elements kept for backward by the decoder layers over tokens (see the module docstring)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # a MoE layer's MLP: each token's top_k experts (5 i each, as a dense MLP's) and its router's logits and
        # probabilities over every expert, plus its input and output gathered once per expert it runs through
        mlp = (self.top_k * (5 * self.moe_intermediate_size + 2 * h) + 2 * self.num_experts if self.num_experts
               else 5 * self.intermediate_size)
        per_layer = 5 * h + 6 * q + 4 * kv + mlp
        if checkpointing:
            return tokens * (self.num_layers * h + per_layer)
        return tokens * self.num_layers * per_layer


def shape_from_config(config: dict[str, Any], role: str) -> Shape:
    """The Shape of an HF Qwen3 (or Qwen3-MoE, every layer sparse) config.json (a dict) for the actor or the critic."""
    heads = config["num_attention_heads"]
    moe = {}
    if config.get("model_type") == "qwen3_moe":
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            raise SlurmError("memory: a Qwen3-MoE config with dense layers among the sparse ones (mlp_only_layers, "
                             "decoder_sparse_step) is not modelled")
        moe = {"num_experts": config["num_experts"], "top_k": config["num_experts_per_tok"],
               "moe_intermediate_size": config["moe_intermediate_size"]}
    return Shape(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                 intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
                 num_heads=heads, num_kv_heads=config.get("num_key_value_heads", heads),
                 head_dim=config.get("head_dim") or config["hidden_size"] // heads, lm_head=role == "actor",
                 tied=role == "actor" and bool(config.get("tie_word_embeddings", False)), **moe)


def tiny_shapes(tiny: Any) -> dict[str, Shape]:
    """Actor and critic shapes of a models.tiny section (qualify.matrix.TinyModel)."""
    moe = {} if tiny.moe is None else {"num_experts": tiny.moe.num_experts, "top_k": tiny.moe.top_k,
                                       "moe_intermediate_size": tiny.moe.moe_intermediate_size}
    return {role: Shape(vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size,
                        intermediate_size=tiny.intermediate_size, num_layers=tiny.num_layers,
                        num_heads=tiny.num_heads, num_kv_heads=tiny.num_kv_heads, head_dim=tiny.head_dim,
                        lm_head=role == "actor", tied=role == "actor" and bool(tiny.tie_word_embeddings),
                        **(moe if role == "actor" else {}))
            for role in ROLES}


FAMILY_ROLES = {"actor": 2, "critic": 2}
"""Models of a family per shape: the actor's (actor, reference policy) and the critic's (critic, reward)."""
TINY_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "num_experts", "moe_intermediate_size")
"""The Shape fields a tiny family's parameters grow with (each a models.tiny field, the last two of its moe)."""


def host_memory_bytes() -> int:
    """This machine's physical memory (0 when the system does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 0


def family_parameters(shapes: dict[str, Shape]) -> int:
    return sum(n * shapes[role].params for role, n in FAMILY_ROLES.items())


def tiny_family_problem(tiny: Any, host_bytes: int) -> str | None:
    """Why a models.tiny family cannot be made here (None: it can): its four models in fp32 (what the reference stage
    makes in host memory, before anything else) exceed host_bytes. The message names the size that weighs most (the
    one whose halving frees the most)."""
    shapes = tiny_shapes(tiny)
    params = family_parameters(shapes)
    if host_bytes <= 0 or COMPUTE_BYTES["fp32"] * params <= host_bytes:
        return None

    def halved(field: str) -> int:
        return family_parameters({role: dataclasses.replace(shape, **{field: max(1, getattr(shape, field) // 2)})
                                  for role, shape in shapes.items()})
    heaviest = min((f for f in TINY_SIZES if getattr(shapes["actor"], f)), key=halved)
    where = f"moe.{heaviest}" if heaviest in ("num_experts", "moe_intermediate_size") else heaviest
    return (f"models.tiny.{where} {getattr(shapes['actor'], heaviest)}: the tiny family's four models hold "
            f"{params:.3g} parameters, {COMPUTE_BYTES['fp32'] * params / GiB:.1f} GiB in fp32, over the "
            f"{host_bytes / GiB:.1f} GiB of this machine's memory")


def matrix_shapes(models: Any, resolve: Callable[[str], Path]) -> dict[str, Shape] | None:
    """Actor and critic shapes of a matrix's models section: from models.tiny, or the checkpoints' config.json
    (resolve: Matrix.resolve; None when a checkpoint directory is not there: then nothing can be checked)."""
    if models.tiny is not None:
        return tiny_shapes(models.tiny)
    shapes = {}
    for role in ROLES:
        path = resolve(getattr(models.checkpoints, role)) / "config.json"
        if not path.is_file():
            return None
        shapes[role] = shape_from_config(json.loads(path.read_text()), role)
    return shapes


@dataclass(frozen=True, slots=True)
class Need:
    """What one stage (or case) needs on each GPU it uses and in host memory, with the parts that make it up."""

    what: str
    """'reference fp32 actor', 'case megatron-bf16-tp2-actor', ..."""
    gpu_bytes: int
    host_bytes: int
    parts: dict[str, int] = field(default_factory=dict)
    """GPU bytes by part: 'state' (bytes per parameter x parameters), 'activations', 'logits'."""

    def gpu_gib(self) -> float:
        return self.gpu_bytes / GiB

    def describe(self) -> str:
        """'needs 151.3 GiB a GPU (state 140.2 GiB + activations 9.8 GiB + logits 1.3 GiB); host 295.0 GiB'."""
        parts = " + ".join(f"{k} {v / GiB:.1f} GiB" for k, v in self.parts.items() if v)
        return f"{self.what} needs {self.gpu_gib():.1f} GiB a GPU ({parts}); host {self.host_bytes / GiB:.1f} GiB"


@dataclass(frozen=True, slots=True)
class Workload:
    """What sizes a step's memory, from the matrix's rollout, ppo and reference sections (Workload.of)."""

    tokens: int
    """Tokens of one optimizer step's forward: the step's rows x the padded sequence length."""
    steps: int
    """Optimizer steps (epochs x minibatches): each keeps its evidence."""
    chunk_tokens: int
    """reference.logprob_chunk_tokens: the logprobs' chunk."""

    @classmethod
    def of(cls, rollout: Any, ppo: Any, reference: Any) -> Workload:
        rows = math.ceil(rollout.num_prompts / ppo.minibatches)
        return cls(tokens=rows * (rollout.prompt_len + rollout.max_new_tokens), steps=ppo.epochs * ppo.minibatches,
                   chunk_tokens=reference.logprob_chunk_tokens)


def _activations(work: Workload, shape: Shape, precision: str, checkpointing: bool, tp: int = 1) -> dict[str, int]:
    tokens, b = work.tokens, COMPUTE_BYTES[precision]
    out = {"activations": shape.activation_elements(tokens, checkpointing) * b // tp, "logits": 0}
    if shape.lm_head:
        chunk = min(work.chunk_tokens, tokens)
        out["logits"] = 2 * tokens * shape.vocab_size * b + LOGPROB_CHUNK_BUFFERS * chunk * shape.vocab_size * 4
    return out


def reference_needs(ref: Any, work: Workload, shapes: dict[str, Shape]) -> list[Need]:
    """One Need per precision and role of the reference's scoring (the reference job runs them one at a time)."""
    steps = work.steps
    offload = ref.offload == "host"
    needs = []
    for precision in ref.precisions:
        for role, shape in shapes.items():
            p = shape.params
            state = (OFFLOAD_DEVICE if offload else REFERENCE_STATE)[precision] * p
            host = (EVIDENCE_PER_STEP * steps + (OFFLOAD_HOST if offload else 4)) * p
            parts = {"state": state, **_activations(work, shape, precision, ref.gradient_checkpointing)}
            needs.append(Need(what=f"reference {precision} {role}" + (" (offload: host)" if offload else ""),
                              gpu_bytes=sum(parts.values()), host_bytes=host, parts=parts))
    return needs


def candidate_need(work: Workload, shapes: dict[str, Shape], case: Any) -> Need:
    """What one candidate case needs on each of its TP GPUs (the engines keep an FP32 master and AdamW state on
    every rank for its shard) and on the host of rank 0 (the evidence, gathered whole)."""
    shape = shapes[case.role]
    replicated = shape.replicated_params(case.engine)
    per_rank = (shape.params - replicated) // case.tp + replicated
    steps = work.steps
    parts = {"state": CANDIDATE_STATE[case.precision] * per_rank,
             **_activations(work, shape, case.precision, False, case.tp)}
    return Need(what=f"case {case.name}", gpu_bytes=sum(parts.values()),
                host_bytes=(EVIDENCE_PER_STEP * steps + 8) * shape.params, parts=parts)


def vllm_need(rollout: Any, shapes: dict[str, Shape], tp: int) -> Need:
    """The reference job's vLLM capture on each of its TP GPUs: the weights' shard and the KV-cache budget."""
    p = shapes["actor"].params
    parts = {"state": COMPUTE_BYTES[rollout.dtype] * p // tp, "kv_cache": rollout.kv_cache_memory_bytes}
    return Need(what=f"vLLM TP{tp} capture", gpu_bytes=sum(parts.values()), host_bytes=0, parts=parts)


def gpu_fits(need: Need, gpu_bytes: int) -> bool:
    """need fits a GPU of gpu_bytes, CONTEXT_BYTES kept free."""
    return need.gpu_bytes + CONTEXT_BYTES <= gpu_bytes


def misfits(matrix: Any, cases: list[Any], gpu_bytes: int,
            host_bytes: dict[str, int | None] | None = None) -> tuple[list[str], dict[str, Shape] | None]:
    """The needs that do not fit one GPU of gpu_bytes (or the host memory their job gets), as one line each.

    host_bytes: the host memory the reference job ('reference') and a case's job (the case's name) get (None or
    absent: not checked). Returns (lines, shapes); shapes None when the checkpoints' config.json is not there
    (then nothing was checked).
    """
    shapes = matrix_shapes(matrix.models, matrix.resolve)
    if shapes is None:
        return [], None
    limits, work = host_bytes or {}, Workload.of(matrix.rollout, matrix.ppo, matrix.reference)
    checks = [(n, "reference") for n in reference_needs(matrix.reference, work, shapes)]
    checks += [(vllm_need(matrix.rollout, shapes, tp), "vllm") for tp in matrix.rollout.vllm_tp]
    checks += [(candidate_need(work, shapes, c), c.name) for c in cases]
    lines = []
    for need, job in checks:
        if not gpu_fits(need, gpu_bytes):
            hint = ""
            if need.what.startswith("reference") and matrix.reference.offload != "host":
                offloaded = _with_offload(matrix.reference, work, shapes, need.what)
                hint = f"; with reference.offload: host it needs {offloaded.gpu_gib():.1f} GiB"
            lines.append(f"{need.describe()}, over the {gpu_bytes / GiB:.1f} GiB of one GPU "
                         f"(less {CONTEXT_BYTES / GiB:.0f} GiB kept free){hint}")
        elif limits.get(job) is not None and need.host_bytes > limits[job]:
            lines.append(f"{need.describe()}, over the {limits[job] / GiB:.1f} GiB of host memory its job gets")
    return lines, shapes


def _with_offload(reference: Any, work: Workload, shapes: dict[str, Shape], what: str) -> Need:
    import dataclasses

    offloaded = reference_needs(dataclasses.replace(reference, offload="host"), work, shapes)
    key = what.split(" (")[0]
    return next(n for n in offloaded if n.what.startswith(key))
