"""deepspeed: Hugging Face Qwen3 under DeepSpeed at ZeRO stage 0 to 3, TP by DeepSpeed AutoTP, DP by DeepSpeed itself
(gloo or NCCL).

The engine names are the stage: `deepspeed` is ZeRO-0, `deepspeed-zero1` to `deepspeed-zero3` stages 1 to 3 (one
adapter, zero_stage its argument; qualify.engines.deepspeed_zero holds what the stages add). DP (ctx.dp > 1):
DeepSpeed's own data parallelism over the launch's ranks; it averages gradients, so the adapter scales each rank's
loss share by dp to make the average the sum of the shares. TP x DP: AutoTP's ranks are DeepSpeed's (dp, tp) mesh,
TP ranks contiguous as the launch lays them out; the TP shards are gathered over its TP group.
Under ZeRO 1-3 every exported tensor is read through DeepSpeed's own gathers (safe_get_full_grad,
safe_get_full_fp32_param, safe_get_full_optimizer_state), the norm is DeepSpeed's (get_global_grad_norm()), and the
state is exported only where the DP ranks' fragments cover the parameter exactly once (deepspeed_zero.incomplete_state).

What DeepSpeed 0.19.8 does here, read in its source and measured on the tiny Qwen3:
- The config alone shards the model: deepspeed.initialize with tensor_parallel.autotp_size > 1
  applies the HF tp plan (config.base_model_tp_plan + the causal LM's _tp_plan) through AutoTP
  (runtime/engine.py _apply_autotp_partitioning; tp_model_init is not needed). q/k/v, gate/up and
  lm_head become LinearLayer (column parallel: weight split along dim 0; lm_head gathers its output,
  so every rank holds the full logits); o/down become LinearAllreduce (row parallel: weight split
  along dim 1). q_norm/k_norm stay whole with a TP all-reduce hook on their gradient; embeddings,
  RMSNorms and the critic's score head stay whole and replicated. Splits may be uneven, never padded.
- fp32: the optimizer is torch's AdamW itself. The engine clips with runtime.utils.clip_grad_norm_
  and throws the norm away (get_global_grad_norm() stays None), so the adapter keeps it.
- bf16 at ZeRO-0 is FP16_UnfusedOptimizer in bf16 mode: bf16 parameters accumulate bf16 .grad
  (data_types.grad_accum_dtype=fp32 raises NotImplementedError at stage 0); inside step() the
  grads are cast to FP32 onto FP32 master copies, clipped, and torch's AdamW steps the masters,
  whose state is FP32.

Traps handled here (each a class attribute, so that a test can put it back and see it fail):
- gradient_clipping defaults to 1.0 and silently clips: always set from the matrix.
- bf16: the FP32 masters are cloned from the bf16-cast model; they are loaded from the FP32
  checkpoint instead, as a checkpoint restore would.
- bf16: FP16_UnfusedOptimizer.initialize_optimizer_states runs one AdamW step on zero gradients
  at construction (ZeRO-1/2 and BF16_Optimizer do not): weight decay once, and step count 1, so
  the first real update has the bias correction of step 2 (|update| 0.74 lr instead of lr). That
  state is dropped.
- bf16, TP > 1: its global norm (runtime/utils.get_weight_norm on gradient tensors) skips every
  tensor without the tensor_model_parallel mark on TP ranks > 0, and the mark is on the
  parameters, not on their gradients: the sharded gradients of ranks > 0 drop out of the norm and
  the clip uses a norm too small (2.17 for 2.71). The sharded parameters' gradients get the mark.
step() returns the norm DeepSpeed clipped with and logs when it differs from the exported gradients'.
A packed micro-batch (qualify.case.context.PackedBatch) is scored through transformers' packed position_ids path, as
torch-tp scores it; DeepSpeed accumulates a step's micro-batches with its own accumulation boundary
(set_gradient_accumulation_boundary: False before the step's last micro-batch, whose backward reduces across DP).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from qualify.engines.base import Batch, EngineContext, OutputScoring, PackedBatch
from qualify.engines.deepspeed_zero import ZERO_STAGES, accumulation_dtype, incomplete_state, zero_config
from qualify.engines.shard_coverage import complete_state
from qualify.errors import EngineError
from qualify.models.hf import dtype_name, load_model

# Relative difference between DeepSpeed's global norm and the exported gradients' norm above which
# the log says so (summation order alone gives ~1e-7).
NORM_REPORT_RTOL = 1e-5


def ds_config(ctx: EngineContext, gradient_clipping: float | None, zero_stage: int = 0) -> dict:
    """The DeepSpeed config of a case at a ZeRO stage; gradient_clipping None leaves DeepSpeed's default (1.0)."""
    o = ctx.optimizer
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
        "tensor_parallel": {"autotp_size": ctx.tp},
        # torch_adam + adam_w_mode: torch.optim.AdamW itself (not FusedAdam or CPUAdam);
        # foreach=False as the reference, so the update is the same loop on every device.
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                                   "weight_decay": o.weight_decay, "torch_adam": True,
                                                   "adam_w_mode": True, "foreach": False}},
        "bf16": {"enabled": ctx.precision == "bf16"},
        "steps_per_print": 2**31 - 1,
    }
    if zero_stage:
        config.update(zero_config(zero_stage, ctx.precision == "bf16"))
    if gradient_clipping is not None:
        config["gradient_clipping"] = gradient_clipping
    return config


def tp_layout(module: torch.nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
    """{HF name: (split dim, sizes of every rank's shard)} of the parameters AutoTP sharded."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, TensorParallel_Layer

    layout = {}
    for prefix, mod in module.named_modules():
        if not isinstance(mod, TensorParallel_Layer) or not mod.is_tp_parallel:
            continue
        if isinstance(mod, LinearAllreduce):  # row parallel: the bias is whole
            layout[f"{prefix}.weight"] = (1, mod._partition_sizes)
        elif isinstance(mod, LinearLayer):  # column parallel: weight and bias split along the output
            for pname, _ in mod.named_parameters(recurse=False):
                layout[f"{prefix}.{pname}"] = (0, mod._partition_sizes)
        else:
            raise EngineError(f"deepspeed: AutoTP made '{prefix}' a {type(mod).__name__}; the adapter can "
                              "export LinearLayer and LinearAllreduce shards only")
    return layout


def gather_dim(local: torch.Tensor, dim: int, sizes: tuple[int, ...], group: Any = None) -> torch.Tensor:
    """Full tensor from every TP rank's shard along dim (shards may differ in size: pad, gather, trim); group: the TP
    group (None: the whole world, which is the TP group at DP1)."""
    width = max(sizes)
    pad = [0, 0] * (local.dim() - dim - 1) + [0, width - local.shape[dim]]
    padded = torch.nn.functional.pad(local.detach().contiguous(), pad)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(parts, sizes)], dim)


def set_short_zero3_master(p: torch.nn.Parameter, value: torch.Tensor) -> bool:
    """Set a ZeRO-3 parameter's FP32 master partition from its whole value when the rank's padded partition runs past
    the value's end (a parameter of fewer elements than DP ranks x partition, such as the critic's one-element value
    bias at DP2): DeepSpeed's set_full_hp_param narrows the unpadded value there and fails. The partition gets the
    value's elements it covers and zeros in its padding, as DeepSpeed partitions a parameter. False: not such a case
    (not ZeRO-3, or the partition lies within the value), for safe_set_full_fp32_param."""
    opt = getattr(p, "_z3_optimizer", None)
    if opt is None or not p.requires_grad:
        return False
    part, _ = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False)
    start = part.numel() * opt._get_param_partition_rank(p)
    if start + part.numel() <= value.numel():
        return False
    piece = value.flatten()[start:start + part.numel()]
    part.data.zero_()
    part.data[:piece.numel()].copy_(piece)
    return True


class DeepSpeedEngine(OutputScoring):
    """The deepspeed engine at a ZeRO stage (see module docstring)."""

    name = "deepspeed"
    gradient_clipping_from_matrix = True
    """False leaves gradient_clipping unset: DeepSpeed's default of 1.0."""
    masters_from_checkpoint = True
    """bf16: False keeps DeepSpeed's FP32 masters cloned from the bf16 model."""
    forget_zero_grad_step = True
    """bf16, ZeRO-0: False keeps the AdamW state of DeepSpeed's zero-gradient step at construction."""
    mark_sharded_grads = True
    """bf16, ZeRO-0, TP > 1: False lets DeepSpeed's norm drop the sharded gradients of TP ranks > 0."""
    packed = True
    """Takes packed batches (see the module docstring)."""

    def __init__(self, zero_stage: int = 0) -> None:
        if zero_stage not in (0, *ZERO_STAGES):
            raise EngineError(f"deepspeed: ZeRO stage {zero_stage} does not exist (0 to 3)")
        self.zero_stage = zero_stage
        if zero_stage and type(self).name == DeepSpeedEngine.name:
            self.name = f"deepspeed-zero{zero_stage}"

    def setup(self, ctx: EngineContext) -> None:
        if ctx.device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        # The shm comm op is a JIT g++ build (minutes and gigabytes: benchmarks/LOG.md) that gloo does not need.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.utils.logger.setLevel(logging.WARNING)
        self.ctx = ctx
        model = load_model(ctx.model_dir, ctx.role, "sdpa")
        fp32_full = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.full_shapes = {n: t.shape for n, t in fp32_full.items()}
        clip = ctx.optimizer.max_grad_norm if self.gradient_clipping_from_matrix else None
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(ctx, clip, self.zero_stage))
        self.bf16 = self.engine.bfloat16_enabled()
        self.layout = tp_layout(self.engine.module)
        self.tp_group = None
        if ctx.tp > 1:  # AutoTP's (dp, tp) mesh: TP ranks contiguous, as the launch lays them out
            from deepspeed.utils import groups

            self.tp_group = groups.get_tensor_model_parallel_group()
        self.read_grad_dtypes: dict[str, str] = {}
        self.exported_norm: torch.Tensor | None = None
        if self.zero_stage:
            self._setup_zero(fp32_full)
        else:
            self._setup_zero0(fp32_full)
        self.inner_optimizer().register_step_pre_hook(self._record_read_grad_dtypes)

    def _setup_zero0(self, fp32_full: dict[str, torch.Tensor]) -> None:
        self.masters = self._masters()
        if self.bf16 and self.forget_zero_grad_step:
            self._forget_zero_grad_step()
        if self.bf16 and self.masters_from_checkpoint:
            self._load_fp32_masters(fp32_full)
        self.fp32_clip_norm: torch.Tensor | None = None
        if not self.bf16:
            self._keep_fp32_clip_norm()

    def _setup_zero(self, fp32_full: dict[str, torch.Tensor]) -> None:
        self.params_by_name = dict(self.engine.module.named_parameters())
        accumulated = accumulation_dtype(self.engine.optimizer)
        if accumulated != torch.float32:
            raise EngineError(f"deepspeed ZeRO-{self.zero_stage}: {type(self.engine.optimizer).__name__} accumulates "
                              f"gradients in {accumulated}, not FP32")
        if self.bf16 and self.masters_from_checkpoint:
            from deepspeed.utils import safe_set_full_fp32_param

            device = next(self.engine.module.parameters()).device
            for name, p in self.params_by_name.items():  # the bf16 parameters are these masters cast: untouched
                value = self._tp_shard(name, fp32_full[name]).to(device)
                if not set_short_zero3_master(p, value):
                    safe_set_full_fp32_param(p, value)

    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The torch AdamW that steps the masters (wrapped by DeepSpeed's optimizer under bf16 or ZeRO)."""
        return self.engine.optimizer.optimizer if self.bf16 or self.zero_stage else self.engine.optimizer

    def _masters(self) -> dict[str, tuple[torch.nn.Parameter, torch.Tensor]]:
        """ZeRO-0: {HF name: (model parameter, FP32 master the optimizer steps)}."""
        params = dict(self.engine.module.named_parameters())
        if not self.bf16:
            return {n: (p, p) for n, p in params.items()}
        opt = self.engine.optimizer
        by_id = {id(lp): hp for lps, hps in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lps, hps)}
        missing = [n for n, p in params.items() if id(p) not in by_id]
        if missing:
            raise EngineError(f"deepspeed: no FP32 master for {', '.join(missing[:3])} ({len(missing)} parameters)")
        return {n: (p, by_id[id(p)]) for n, p in params.items()}

    def _forget_zero_grad_step(self) -> None:
        state = self.inner_optimizer().state
        for s in state.values():  # what the zero-gradient step leaves; anything else is not ours to drop
            assert int(s["step"]) == 1 and not s["exp_avg"].any() and not s["exp_avg_sq"].any(), s["step"]
        state.clear()

    def _tp_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's shard of a full tensor, split as AutoTP split the parameter."""
        if name not in self.layout:
            return full
        dim, sizes = self.layout[name]
        return full.split(sizes, dim)[self.ctx.tp_rank]

    @torch.no_grad()
    def _load_fp32_masters(self, fp32_full: dict[str, torch.Tensor]) -> None:
        for name, (p, master) in self.masters.items():
            shard = self._tp_shard(name, fp32_full[name])
            assert torch.equal(shard.to(p.device, p.dtype), p), f"{name}: the FP32 shard does not cast to the model's"
            master.copy_(shard)

    def _keep_fp32_clip_norm(self) -> None:
        """DeepSpeedEngine.clip_fp32_gradients, keeping the pre-clip norm it computes and discards."""
        from deepspeed.runtime.utils import clip_grad_norm_

        engine = self.engine

        def clip_fp32_gradients() -> None:
            self.fp32_clip_norm = clip_grad_norm_(parameters=engine.module.parameters(),
                                                  max_norm=engine.gradient_clipping(), mpu=engine.mpu)

        engine.clip_fp32_gradients = clip_fp32_gradients

    def _record_read_grad_dtypes(self, optimizer, args, kwargs) -> None:
        if self.zero_stage:  # the flat FP32 partitions of the DP rank: one name for each
            read = [m for g in optimizer.param_groups for m in g["params"] if m.grad is not None]
            self.read_grad_dtypes = {f"partition{i}": dtype_name(m.grad) for i, m in enumerate(read)}
            return
        names = {id(m): n for n, (_, m) in self.masters.items()}
        self.read_grad_dtypes = {names[id(m)]: dtype_name(m.grad) for g in optimizer.param_groups
                                 for m in g["params"] if m.grad is not None}

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """A copy of the full tensor of a parameter-shaped local tensor, on CPU, in its own dtype.

        Always a copy: the gradients are exported before step() clips them in place.
        """
        if name in self.layout:
            local = gather_dim(local, *self.layout[name], group=self.tp_group)
        return local.detach().to("cpu", copy=True)

    def score(self, batch: Batch | PackedBatch) -> torch.Tensor:
        device = next(self.engine.module.parameters()).device
        # the step's last micro-batch (every padded batch is one) is DeepSpeed's accumulation boundary
        self.engine.set_gradient_accumulation_boundary(not isinstance(batch, PackedBatch) or batch.last)
        if isinstance(batch, PackedBatch):
            ids_1N, pos_1N = batch.input_ids_1N.to(device), batch.position_ids_1N.to(device)
            return self.packed_scores_from(self.engine(input_ids=ids_1N, position_ids=pos_1N, use_cache=False).logits,
                                           batch)
        ids_BT = batch.input_ids_BT.to(device)
        with self.routed(self.engine.module, batch):  # routes afresh: this engine does not replay a rollout's
            logits = self.engine(input_ids=ids_BT, use_cache=False).logits
        return self.scores_from(logits, ids_BT)

    def layer_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Full fp32 outputs of every decoder layer's modules and the final norm (qualify diagnose): AutoTP keeps
        the HF module tree, and its row-parallel layers all-reduce, so every hooked output is whole (ZeRO-3's hooks
        gather each module's parameters for its forward)."""
        from qualify.models.hooks import capture_layer_outputs

        return capture_layer_outputs(self.engine.module, batch.input_ids_BT)

    def backward(self, loss: torch.Tensor) -> None:
        # DP: DeepSpeed averages gradients over its data-parallel ranks, but each rank's loss is already its share
        # of the step's (global normalizers): scaling by dp (a power of two here, exact) makes the average a sum
        self.engine.backward(loss * self.ctx.dp if self.ctx.dp > 1 else loss)

    def grads(self) -> dict[str, torch.Tensor]:
        if not self.zero_stage:  # under bf16 the optimizer reads grad.to(float32) of these: the cast is exact
            return {n: self.full(n, p.grad).float() for n, (p, _) in self.masters.items()}
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for name, p in self.params_by_name.items():  # DP collectives, in the same order on every rank
            grad = safe_get_full_grad(p)
            if grad is None:
                raise EngineError(f"deepspeed ZeRO-{self.zero_stage}: no gradient of {name} after backward")
            out[name] = self.full(name, grad).float()
        # every rank holds the whole gradients: their norm needs no collective (each in float64 on the CPU)
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in out.values()])
        self.exported_norm = torch.linalg.vector_norm(norms).to(torch.float32)
        return out

    def grad_dtypes(self) -> dict[str, str]:
        # fp32: the optimizer reads p.grad. bf16 ZeRO-0: step() sets master.grad = p.grad.to(master.dtype). ZeRO 1-3:
        # the FP32 partitions of the gradients DeepSpeed accumulates. step() checks this against what it really read.
        if self.zero_stage:
            accumulated = str(accumulation_dtype(self.engine.optimizer)).removeprefix("torch.")
            self.reported_grad_dtypes = dict.fromkeys(self.params_by_name, accumulated)
        else:
            self.reported_grad_dtypes = {n: dtype_name(p.grad) if p is m else dtype_name(m)
                                         for n, (p, m) in self.masters.items()}
        return self.reported_grad_dtypes

    def exported_grad_norm(self) -> torch.Tensor:
        """ZeRO-0: global L2 norm of the full gradients: per-parameter norms, then the norm of those (fp32)."""
        sq = torch.stack([p.grad.float().pow(2).sum() for p, _ in self.masters.values()])
        if self.ctx.tp > 1:
            sharded = torch.tensor([n in self.layout for n in self.masters], device=sq.device)
            summed = sq.clone()
            dist.all_reduce(summed, group=self.tp_group)
            sq = torch.where(sharded, summed, sq)
        return torch.linalg.vector_norm(sq.sqrt()).cpu()

    def step(self) -> torch.Tensor:
        exported = self.exported_norm if self.zero_stage else self.exported_grad_norm()
        if self.bf16 and not self.zero_stage and self.mark_sharded_grads:
            for name, (p, _) in self.masters.items():
                if name in self.layout:
                    p.grad.tensor_model_parallel = True
        self.engine.step()
        self._check_read_grad_dtypes()
        if self.zero_stage:
            ds_norm = self.engine.get_global_grad_norm()
        else:
            ds_norm = self.engine.get_global_grad_norm() if self.bf16 else self.fp32_clip_norm
        if ds_norm is None:  # fp32 ZeRO-0 without clipping: DeepSpeed computes no norm
            return exported
        ds_norm = torch.as_tensor(ds_norm).reshape(()).to("cpu", torch.float32)
        if exported is not None and dist.get_rank() == 0 and \
                abs(float(ds_norm) - float(exported)) > NORM_REPORT_RTOL * float(exported):
            print(f"deepspeed: DeepSpeed clipped with global grad norm {float(ds_norm):.9g}; the exported "
                  f"gradients' norm is {float(exported):.9g}", file=sys.stderr, flush=True)
        return ds_norm

    def _check_read_grad_dtypes(self) -> None:
        reported = getattr(self, "reported_grad_dtypes", None)
        if reported is None:
            return
        read = self.read_grad_dtypes
        if (set(read.values()) != set(reported.values())) if self.zero_stage else read != reported:
            raise EngineError("deepspeed: the optimizer read gradients of other dtypes than reported: "
                              f"{sorted(set(read.items()) ^ set(reported.items()))[:3]}")

    def params(self) -> dict[str, torch.Tensor]:
        if not self.zero_stage:
            return {n: self.full(n, m).float() for n, (_, m) in self.masters.items()}
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: self.full(n, safe_get_full_fp32_param(p)).float() for n, p in self.params_by_name.items()}

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
        if self.zero_stage:
            return self._zero_optimizer_state(out)
        state = self.inner_optimizer().state
        for name, (_, master) in self.masters.items():
            if master in state:
                for key, by_name in out.items():
                    by_name[name] = self.full(name, state[master][key])
        return out

    def _zero_optimizer_state(self, out: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """The AdamW state consolidated by DeepSpeed's own gather, in the dtype its partitions hold it in, for every
        parameter whose fragments the DP ranks of every TP rank hold exactly once and whose gathered state has the
        parameter's full shape (shard_coverage.complete_state); any other parameter's state is left out (an evidence
        row names it) and logged."""
        from deepspeed.utils import safe_get_full_optimizer_state

        held = {key: {s[key].dtype for s in self.inner_optimizer().state.values()} for key in out}
        incomplete = incomplete_state(self.params_by_name, self.engine.seq_data_parallel_group)
        for name, p in self.params_by_name.items():  # DP collectives, in the same order on every rank
            for key, by_name in out.items():
                full = self.full(name, safe_get_full_optimizer_state(p, key))
                by_name[name] = full.to(*held[key]) if len(held[key]) == 1 else full
        everywhere: list[Any] = [None] * dist.get_world_size()  # what any TP rank's DP group found incomplete
        dist.all_gather_object(everywhere, incomplete)
        out, left_out = complete_state(out, self.full_shapes, {n: w for found in everywhere for n, w in found.items()})
        if dist.get_rank() == 0:
            for name, why in left_out.items():
                print(f"deepspeed ZeRO-{self.zero_stage}: the optimizer state of {name} is not complete: {why}",
                      file=sys.stderr, flush=True)
        return out

    def replicated(self) -> dict[str, torch.Tensor]:
        if not self.zero_stage:
            return {n: m.detach().float().cpu() for n, (_, m) in self.masters.items() if n not in self.layout}
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).detach().float().cpu() for n, p in self.params_by_name.items()
                if n not in self.layout}

    def padded_rows(self) -> dict[str, torch.Tensor]:
        return {}  # AutoTP splits vocab-sized weights unevenly, it never pads them

    def close(self) -> None:
        self.engine.destroy()
        self.engine = self.masters = self.params_by_name = None
