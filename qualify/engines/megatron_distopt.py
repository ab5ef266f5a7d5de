"""Megatron's distributed optimizer for the megatron adapter (qualify.engines.megatron, engine `megatron-distopt`):
the FP32 masters and the AdamW state sharded over the data-parallel ranks, read back through megatron-core's own
gathers.

What megatron-core 0.16.1 does, read in its source (megatron/core/optimizer/distrib_optimizer.py,
distributed/param_and_grad_buffer.py):
- With DistributedDataParallelConfig(use_distributed_optimizer=True) the DDP buffers are padded so that each bucket
  splits evenly over the DP ranks; after backward, finish_grad_sync reduce-scatters each bucket's gradients, leaving
  the reduced gradients of rank r in its r-th shard of the bucket (the other shards hold its own unreduced ones).
  full_main_grads gathers the shards (all_gather_into_tensor over the bucket's DP group, as megatron-core gathers the
  parameter buffer after the step) and reads each parameter at its place in the buffer (param_index_map).
- DistributedOptimizer keeps, per DP rank, the FP32 master and the AdamW state of the parameter ranges of its shards
  only (for bf16 parameters the masters are cloned from the bf16 parameters: loaded from the FP32 checkpoint instead,
  with _copy_model_params_to_main_params(state_dict), megatron-core's own path for reloading masters);
  get_parameter_state_dp_zero gathers param, exp_avg and exp_avg_sq of every bucket into one flat, unpadded tensor
  per buffer, which gathered_state cuts back into parameters. Before the first step there is no AdamW state, and
  that gather cannot run.
- The ranges each DP rank holds (the optimizer's gbuf_ranges) must cover every parameter exactly once:
  incomplete_state checks it (qualify.engines.shard_coverage).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from qualify.engines.shard_coverage import coverage_problem

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def optimizer_parts(optimizer: Any) -> list[Any]:
    """The DistributedOptimizers of a (possibly chained: a MoE model's experts get their own) Megatron optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def buffer_offsets(buffer: Any) -> Iterable[tuple[Any, Any, int]]:
    """(bucket, param, offset of the param in its bucket) for every parameter of a DDP buffer."""
    for param, (start, _, bucket_id) in buffer.param_index_map.items():
        bucket = buffer.buckets[bucket_id]
        yield bucket, param, start - bucket.offset


def full_main_grads(ddp: Any) -> dict[Any, torch.Tensor]:
    """{model parameter: its reduced gradient, whole} from the reduce-scattered buckets of a DDP model (a copy)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    out = {}
    for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers]:
        group = buffer.data_parallel_group
        full = {}
        for bucket in buffer.buckets:
            local = shard_buffer(bucket.grad_data, group.size())[group.rank()]
            full[bucket.bucket_id] = torch.empty_like(bucket.grad_data)
            dist.all_gather_into_tensor(full[bucket.bucket_id], local, group=group)
        for bucket, param, offset in buffer_offsets(buffer):
            out[param] = full[bucket.bucket_id][offset:offset + param.numel()].view(param.shape)
    return out


def gathered_state(optimizer: Any) -> dict[Any, dict[str, torch.Tensor]]:
    """{model parameter: {'param', 'exp_avg', 'exp_avg_sq'}} whole FP32 tensors on the CPU, on every rank, through
    get_parameter_state_dp_zero (a collective of the DP group; only after a step)."""
    out: dict[Any, dict[str, torch.Tensor]] = {}
    for part in optimizer_parts(optimizer):
        state = part.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
        for gbuf_idx, buffer in enumerate(part.buffers):
            (world,) = state[gbuf_idx].values()  # one (param, grad) dtype per buffer
            starts, at = {}, 0  # where each bucket's unpadded elements begin in the world tensors
            for bucket in buffer.buckets:
                starts[bucket.bucket_id], at = at, at + bucket.numel_unpadded
            for bucket, param, offset in buffer_offsets(buffer):
                begin = starts[bucket.bucket_id] + offset
                out[param] = {key: world[key][begin:begin + param.numel()].view(param.shape).clone()
                              for key in STATE_KEYS}
    return out


def fragments(optimizer: Any) -> dict[Any, tuple[int, int]]:
    """{model parameter: (start, numel) of the flattened parameter whose master and state this DP rank holds}."""
    out = {}
    for part in optimizer_parts(optimizer):
        for by_dtype in part.gbuf_ranges:
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for param, ranges in bucket["param_map"].items():
                        out[param] = (int(ranges["param"].start), int(ranges["param"].size))
    return out


def incomplete_state(optimizer: Any, named: dict[str, Any], group: Any) -> dict[str, str]:
    """{Megatron name: why} for every parameter whose ranges the DP ranks do not hold exactly once (a collective of
    the DP group)."""
    mine = fragments(optimizer)
    local = {name: mine.get(p, (0, 0)) for name, p in named.items()}
    gathered: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(gathered, local, group=group)
    out = {}
    for name, p in named.items():
        problem = coverage_problem([g[name] for g in gathered], p.numel())
        if problem:
            out[name] = problem
    return out


def load_fp32_masters(optimizer: Any, named: dict[str, Any], shard: dict[str, torch.Tensor]) -> None:
    """Each DP rank's FP32 master ranges from the FP32 checkpoint's shard (Megatron names, this TP rank's), by
    megatron-core's own reload of the masters from a state dict."""
    state_dict = {name: shard[name] for name in named}
    for part in optimizer_parts(optimizer):
        part._copy_model_params_to_main_params(state_dict=state_dict)
