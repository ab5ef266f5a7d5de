"""megatron: a megatron-core GPTModel (local layer spec, no TransformerEngine) behind the engine Protocol.

The HF Qwen3 checkpoint is converted to this rank's TP shard (qualify.engines.megatron_convert)
and loaded into GPTModel with RMSNorm, q/k layernorm, swiglu and RoPE. A Qwen3-MoE checkpoint gets megatron-core's
MoE layers (router, allgather dispatcher, local experts) at TP 1 and replays a batch's routes through megatron-core's
RouterReplay, recording them for the routes() and router_outputs() hooks (qualify.engines.megatron_moe says why its
softmax router is Qwen3-MoE's, and why TP 1). The actor gathers the
vocab-parallel logits to the full padded vocab and scores with the sampler formula over the real
vocab; the critic replaces the output layer by HF's replicated score Linear(hidden, 1).
Training is Megatron's own: DistributedDataParallel with FP32 gradient buffers, Float16Module and
Float16OptimizerWithFloat16Params (FP32 master weights) under bf16 or FP32Optimizer under fp32,
finalize_model_grads (which all-reduces the q/k layernorm gradients across TP), and the optimizer's
clip_grad. Engine `megatron-distopt` (distributed_optimizer=True) takes Megatron's distributed optimizer instead: the
gradients reduce-scattered, the masters and AdamW state sharded over DP (qualify.engines.megatron_distopt reads them
back through megatron-core's own gathers). DP (ctx.dp > 1): the launch's tp x dp ranks are parallel_state's, TP
ranks contiguous; calculate_per_token_loss makes DDP sum the DP ranks' gradients instead of averaging them (each
rank's loss is already its share of the step's: the harness's normalizers are global). Weight decay applies to every tensor, as in the reference (Megatron's usual rule that
skips norms and biases is a configuration choice, not numerics). megatron-core's DDP and optimizer
allocate on CUDA, so this engine runs on GPUs only.
"""

from __future__ import annotations

import math
import sys
import warnings
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from qualify.engines.base import Batch, EngineContext, OutputScoring
from qualify.engines.megatron_convert import (
    Qwen3Layout,
    conversion_plan,
    drop_extra_state,
    hf_to_megatron,
    megatron_to_hf,
    padded_rows,
    param_name,
)
from qualify.engines.megatron_distopt import full_main_grads, gathered_state, incomplete_state, load_fp32_masters
from qualify.engines.megatron_moe import RouteRecorder, define_router_gemm, moe_config
from qualify.errors import EngineError

VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's default make_vocab_size_divisible_by
MOE_TP_REASON = ("the megatron engine runs a Qwen3-MoE model at TP 1 only: megatron-core trains MoE under TP with "
                 "sequence parallelism alone, which the norms of its local spec (no TransformerEngine) refuse")


class ValueHead(torch.nn.Module):
    """The critic's head in GPTModel's output_layer slot: HF's score, Linear(hidden, 1), replicated on every rank.

    Its input (the final norm's output) is whole on every rank, so its gradient needs no TP reduction.
    """

    def __init__(self, hidden_size: int, bias: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(1)) if bias else None

    def forward(self, hidden_SBH: torch.Tensor, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_SBH, self.weight, self.bias), None


def transformer_config(hf_config: Any, layout: Qwen3Layout, ctx: EngineContext):
    """megatron-core TransformerConfig of an HF Qwen3 or Qwen3-MoE config (no dropout, no fusions, no TE)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=layout.num_layers, hidden_size=layout.hidden_size, num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads, kv_channels=layout.head_dim, ffn_hidden_size=layout.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=ctx.tp,
        bf16=ctx.precision == "bf16", params_dtype=torch.float32, attention_softmax_in_fp32=True,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        calculate_per_token_loss=True,  # DDP sums the DP ranks' gradients (gradient_scaling_factor 1): shares add up
        **moe_config(layout))


def ddp_config(distributed_optimizer: bool):
    """megatron-core DistributedDataParallelConfig: FP32 gradient buffers, no overlap (the reductions happen where the
    adapter calls them), the distributed optimizer's reduce-scatter or the plain all-reduce."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
                                         use_distributed_optimizer=distributed_optimizer)


def optimizer_config(ctx: EngineContext, distributed_optimizer: bool):
    """megatron-core OptimizerConfig of the matrix's AdamW (decoupled weight decay) and clip."""
    from megatron.core.optimizer import OptimizerConfig

    o = ctx.optimizer
    return OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.lr, weight_decay=o.weight_decay,
                           adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_eps=o.eps,
                           # clip_grad 0 skips Megatron's norm as well: inf clips nothing, reports the norm
                           clip_grad=o.max_grad_norm if o.max_grad_norm > 0 else float("inf"),
                           bf16=ctx.precision == "bf16", params_dtype=torch.float32,
                           use_distributed_optimizer=distributed_optimizer, decoupled_weight_decay=True)


def rope_theta(hf_config: Any) -> float:
    """RoPE base of an HF config (transformers 5 keeps it in rope_parameters); refuses scaled RoPE."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise EngineError(f"RoPE type {rope['rope_type']!r} is not supported by the megatron engine (default only)")
    return float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


class MegatronEngine(OutputScoring):
    """The megatron engine (see module docstring)."""

    name = "megatron"
    packed = False
    """No packed batches: qualify.engines.catalog.UNPACKED_ENGINES says why (the matrix refuses megatron x packed)."""

    def __init__(self, distributed_optimizer: bool = False) -> None:
        self.distributed_optimizer = distributed_optimizer
        if distributed_optimizer and type(self).name == MegatronEngine.name:
            self.name = "megatron-distopt"

    def setup(self, ctx: EngineContext) -> None:
        if not ctx.device.startswith("cuda"):
            raise EngineError("the megatron engine needs a CUDA device: megatron-core's DDP and optimizer "
                              "allocate on CUDA (its parallel layers alone run on CPU, see the layer tests)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Apex/TransformerEngine not installed, falling back to torch"
            from megatron.core import parallel_state as ps
            from megatron.core import tensor_parallel
        from transformers import AutoConfig

        self.ctx, self.notes = ctx, []
        if torch.device(ctx.device).index is not None:  # plain 'cuda': the launcher already set LOCAL_RANK's device
            torch.cuda.set_device(torch.device(ctx.device))
        if not ps.model_parallel_is_initialized():  # the world's tp x dp ranks: DP is world / tp
            ps.initialize_model_parallel(tensor_model_parallel_size=ctx.tp)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)  # dropout is 0; the tracker must exist
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        layout = (ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size(), self.tp_rank,
                  ps.get_data_parallel_rank())
        if layout != (ctx.tp, ctx.dp, ctx.tp_rank, ctx.dp_rank):
            raise EngineError(f"megatron's parallel state (tp, dp, tp rank, dp rank) {layout} is not the launch's "
                              f"{(ctx.tp, ctx.dp, ctx.tp_rank, ctx.dp_rank)}")
        hf_config = AutoConfig.from_pretrained(str(ctx.model_dir))
        self.layout = Qwen3Layout.from_hf_config(hf_config, ctx.role, VOCAB_DIVISIBLE_BY)
        if hf_config.vocab_size != ctx.vocab_size:
            raise EngineError(f"checkpoint vocab {hf_config.vocab_size} != rollout vocab {ctx.vocab_size}")
        if self.layout.num_experts and ctx.tp > 1:
            raise EngineError(MOE_TP_REASON)
        self.plan = conversion_plan(self.layout)
        self.config = transformer_config(hf_config, self.layout, ctx)
        shard = self._load_shard()
        self.gpt = self._build_model(hf_config, shard)
        self.recorder = None
        if self.layout.num_experts:
            define_router_gemm()
            self.recorder = RouteRecorder(self.gpt)
        self._wrap_and_build_optimizer(shard)

    def _load_shard(self) -> dict[str, torch.Tensor]:
        from qualify.models.checkpoint import initial_parameters

        hf = {k: v.float() for k, v in initial_parameters(self.ctx.model_dir).items()}
        return hf_to_megatron(hf, self.layout, self.ctx.tp)[self.tp_rank]

    def _build_model(self, hf_config: Any, shard: dict[str, torch.Tensor]) -> torch.nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        layer_spec = get_gpt_layer_local_spec(num_experts=self.layout.num_experts or None, moe_grouped_gemm=False,
                                              qk_layernorm=True, normalization="RMSNorm")
        gpt = GPTModel(self.config, layer_spec, vocab_size=self.layout.padded_vocab(self.ctx.tp),
                       max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
                       rotary_base=int(rope_theta(hf_config)),
                       share_embeddings_and_output_weights=self.layout.tie_word_embeddings,
                       parallel_output=True)
        if self.ctx.role == "critic":
            gpt.output_layer = ValueHead(self.layout.hidden_size, self.layout.value_bias)
        result = gpt.load_state_dict(shard, strict=False)
        extra = [k for k in result.missing_keys if k.endswith("._extra_state")]
        missing = sorted(set(result.missing_keys) - set(extra))
        if missing or result.unexpected_keys:
            raise EngineError(f"GPTModel and the converted shard disagree: missing {missing[:8]}, "
                              f"unexpected {sorted(result.unexpected_keys)[:8]}")
        if extra:
            self.notes.append(f"left {len(extra)} _extra_state entries (module metadata) at their defaults")
        return gpt.to(self.ctx.device)

    def _wrap_and_build_optimizer(self, shard: dict[str, torch.Tensor]) -> None:
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(self.config, self.gpt) if self.ctx.precision == "bf16" else self.gpt
        self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config(self.distributed_optimizer),
                                             module=module)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # {} (not None): no wd_mult=0 group for norms and biases; every tensor decays, as in the reference
            self.optimizer = get_megatron_optimizer(optimizer_config(self.ctx, self.distributed_optimizer),
                                                    [self.model], config_overrides={})
        parts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        # a MoE model's experts get an optimizer of their own, clipped by the chain's one global norm
        self.adams = [part.optimizer for part in parts]  # the torch AdamWs holding the moments, keyed by master params
        self.named = {n: p for n, p in self.gpt.named_parameters()}
        self.gathered: dict[Any, dict[str, torch.Tensor]] | None = None  # distributed optimizer: after each step
        if self.distributed_optimizer:
            if self.ctx.precision == "bf16":  # the masters cloned from the bf16 params; the FP32 checkpoint instead
                load_fp32_masters(self.optimizer, self.named, shard)
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            return
        self.master = {n: getattr(p, "main_param", p) for n, p in self.named.items()}
        if self.ctx.precision == "bf16":
            # Float16Optimizer makes its FP32 masters from the bf16 params, dropping the checkpoint's
            # low bits; the reference's masters are the FP32 checkpoint itself.
            with torch.no_grad():
                for name, main in self.master.items():
                    assert main.dtype == torch.float32 and main is not self.named[name], name
                    main.copy_(shard[name])
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def score(self, batch: Batch) -> torch.Tensor:
        ids_BT = batch.input_ids_BT.to(self.ctx.device)
        pos_BT = torch.arange(ids_BT.shape[1], device=ids_BT.device).expand_as(ids_BT)
        with self._replaying(batch):
            out_BTX = self.model(input_ids=ids_BT, position_ids=pos_BT, attention_mask=None,
                                 runtime_gather_output=True)
        if self.recorder is not None:
            self.last_routes = self.recorder.routes(*ids_BT.shape)
            self.last_router = self.recorder.router_outputs(*ids_BT.shape)
        return self.scores_from(out_BTX, ids_BT)

    def _replaying(self, batch: Batch):
        """A MoE model's forward replays batch.routes_BTLK (None: routes afresh); a dense model's runs as it is."""
        return nullcontext() if self.recorder is None else self.recorder.replaying(batch.routes_BTLK)

    def layer_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Full fp32 (B, T, H) outputs of every decoder layer's modules and the final norm under HF names (qualify
        diagnose): megatron-core's layers are hooked (qualify.models.hooks.megatron_modules), seq-first outputs
        transposed; without sequence parallelism the row-parallel outputs are already whole on every rank."""
        from qualify.models.hooks import capture_outputs, megatron_modules

        ids_BT = batch.input_ids_BT.to(self.ctx.device)
        pos_BT = torch.arange(ids_BT.shape[1], device=ids_BT.device).expand_as(ids_BT)
        with self._replaying(batch):
            return capture_outputs(megatron_modules(self.gpt), lambda: self.model(
                input_ids=ids_BT, position_ids=pos_BT, attention_mask=None, runtime_gather_output=True),
                seq_first=True)

    def backward(self, loss: torch.Tensor) -> None:
        from megatron.core.distributed import finalize_model_grads

        loss.backward()
        finalize_model_grads([self.model])

    def _gathered(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full HF tensors from every rank's Megatron-named local tensors (all-gathered over TP)."""
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.ctx.tp)]
        for name in self.plan:
            t = local[name].detach().contiguous()
            parts = [t]
            if self.ctx.tp > 1:
                parts = [torch.empty_like(t) for _ in range(self.ctx.tp)]
                dist.all_gather(parts, t, group=self.tp_group)
            for rank, part in enumerate(parts):
                shards[rank][name] = part.to("cpu", copy=True)  # never a view of a live buffer
        return megatron_to_hf(shards, self.layout, self.notes)

    def grads(self) -> dict[str, torch.Tensor]:
        if self.distributed_optimizer and self.ctx.dp > 1:  # reduce-scattered: each rank holds its shard reduced
            full = full_main_grads(self.model)
            return self._gathered({n: full[p] for n, p in self.named.items()})
        return self._gathered({n: p.main_grad for n, p in self.named.items()})

    def grad_dtypes(self) -> dict[str, str]:
        return {param_name(hf): str(self.named[m].main_grad.dtype).removeprefix("torch.")
                for m, (_, names) in self.plan.items() for hf in names}

    def step(self) -> torch.Tensor:
        success, grad_norm, _ = self.optimizer.step()
        # A skipped step (non-finite gradients) is evidence, not a crash: its norm and the missing optimizer
        # state become failing rows that name them.
        if not success and grad_norm is not None and math.isfinite(float(grad_norm)):
            grad_norm = float("nan")
        self.model.zero_grad_buffer()  # the next step's backward starts from zero (the step copied main -> model)
        self.optimizer.zero_grad()
        if self.distributed_optimizer:
            self.gathered = gathered_state(self.optimizer) if success else None
        return torch.tensor(float("nan") if grad_norm is None else float(grad_norm), dtype=torch.float32)

    def params(self) -> dict[str, torch.Tensor]:
        if self.distributed_optimizer:
            if self.gathered is None:  # no step taken (skipped): the model's own parameters, which it did not move
                return self._gathered({n: p.float() for n, p in self.named.items()})
            return self._gathered({n: self.gathered[p]["param"] for n, p in self.named.items()})
        return self._gathered({n: p.float() for n, p in self.master.items()})

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        if self.distributed_optimizer:
            return self._distributed_state()
        state = {p: s for adam in self.adams for p, s in adam.state.items()}
        if not all(p in state for p in self.master.values()):  # no step was taken (skipped)
            return {"exp_avg": {}, "exp_avg_sq": {}}
        return {key: self._gathered({n: state[p][key] for n, p in self.master.items()})
                for key in ("exp_avg", "exp_avg_sq")}

    def _distributed_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The AdamW state gathered by get_parameter_state_dp_zero after the step, for every parameter whose ranges
        the DP ranks hold exactly once (megatron_distopt.incomplete_state); any other is left out (an evidence row
        names it) and logged."""
        if self.gathered is None:  # no step taken (skipped)
            return {"exp_avg": {}, "exp_avg_sq": {}}
        incomplete = incomplete_state(self.optimizer, self.named, self.dp_group)
        for name, why in sorted(incomplete.items()):
            print(f"megatron-distopt: rank {dist.get_rank()}: the optimizer state of {name} is not complete: {why}",
                  file=sys.stderr, flush=True)
        # the TP ranks gather their shards together: a parameter incomplete on any rank is left out on every rank
        dropped: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(dropped, sorted(incomplete))
        kept = {n: p for n, p in self.named.items() if not any(n in d for d in dropped)}
        return {key: self._gathered_some({n: self.gathered[p][key] for n, p in kept.items()})
                for key in ("exp_avg", "exp_avg_sq")}

    def _gathered_some(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """_gathered over the Megatron names present; the HF names of an absent one are left out."""
        if len(local) == len(self.named):
            return self._gathered(local)
        zeros = {n: torch.zeros_like(self.gathered[p]["param"]) for n, p in self.named.items() if n not in local}
        full = self._gathered({**local, **zeros})
        absent = {param_name(hf) for m, (_, names) in self.plan.items() if m in zeros for hf in names}
        return {n: t for n, t in full.items() if n not in absent}

    def _masters(self) -> dict[str, torch.Tensor]:
        """This rank's FP32 masters under Megatron names (the distributed optimizer's as gathered after the step)."""
        if not self.distributed_optimizer:
            return {n: p.detach() for n, p in self.master.items()}
        if self.gathered is None:  # before the first step: the model's parameters, cast from those masters
            return {n: p.detach() for n, p in self.named.items()}
        return {n: self.gathered[p]["param"] for n, p in self.named.items()}

    def replicated(self) -> dict[str, torch.Tensor]:
        local = drop_extra_state(self._masters(), self.tp_rank, None)
        return {names[0]: local[m].float().cpu() for m, (kind, names) in self.plan.items() if kind == "replicated"}

    def padded_rows(self) -> dict[str, torch.Tensor]:
        """Every padding row of the vocab-sized masters (all-gathered: at TP2 only the last rank holds any)."""
        rows = padded_rows(self._masters(), self.layout, self.ctx.tp, self.tp_rank)
        out = {}
        for name in (names[0] for kind, names in self.plan.values() if kind == "vocab"):
            gathered: list[Any] = [None] * self.ctx.tp
            local = rows[name].float().cpu() if name in rows else None
            if self.ctx.tp > 1:
                dist.all_gather_object(gathered, local, group=self.tp_group)
            else:
                gathered = [local]
            parts = [g for g in gathered if g is not None]
            if parts:
                out[name] = torch.cat(parts)
        return out

    def close(self) -> None:
        from megatron.core import parallel_state as ps

        if self.recorder is not None:
            self.recorder.close()
        self.optimizer = self.adams = self.model = self.gpt = self.recorder = None
        ps.destroy_model_parallel()
