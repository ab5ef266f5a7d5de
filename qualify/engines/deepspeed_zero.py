"""DeepSpeed ZeRO stages 1-3 for the deepspeed adapter (qualify.engines.deepspeed_engine): the config a stage adds,
and the completeness of the sharded state the adapter reads through DeepSpeed's own gathers.

What DeepSpeed 0.19.8 builds per stage, read in its source and measured on the tiny Qwen3 over gloo:
- stage 1, bf16 with data_types.grad_accum_dtype fp32: BF16_Optimizer (engine._do_optimizer_sanity_check), which
  shards the FP32 masters and AdamW state over DP and accumulates FP32 gradients beside the bf16 .grad; stage 1 in
  fp32, and stages 2 and 3 in either precision: DeepSpeedZeroOptimizer (stage 2 also partitions the reduced
  gradients) and DeepSpeedZeroOptimizer_Stage3 (the parameters too: each rank holds 1/dp of every flattened
  parameter, gathered by the forward's hooks). grad_accum_dtype fp32 makes stages 2 and 3 accumulate and hold the
  partitioned gradients in FP32 (at stage 0 DeepSpeed refuses it: NotImplementedError).
- communication_data_type defaults to the model's dtype: under bf16 the gradients are reduced across DP in bf16.
  It is set to fp32 here, so the DP sum of the ranks' shares is taken in fp32.
- Stage 3 keeps a parameter of fewer than stage3_param_persistence_threshold elements (1e5 by default) whole on every
  rank: every weight of the tiny model would stay whole and nothing would be sharded. The threshold is 0.
- DeepSpeed averages gradients over DP (the adapter scales each rank's loss share by dp, as at stage 0), and
  deepspeed.utils.safe_get_full_grad / safe_get_full_fp32_param / safe_get_full_optimizer_state give the whole
  (DP-gathered) tensor of this rank's TP shard on every rank: they are collectives of the DP group.
- No stage steps AdamW on zero gradients at construction (stage 0's FP16_UnfusedOptimizer does), and the masters are
  cloned from the bf16-cast model, as at stage 0: the adapter loads them from the FP32 checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from qualify.engines.shard_coverage import coverage_problem

ZERO_STAGES = (1, 2, 3)


def zero_config(stage: int, bf16: bool) -> dict[str, Any]:
    """What ZeRO stage (1-3) adds to the adapter's DeepSpeed config (see the module docstring)."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter partitioned, however small
    config: dict[str, Any] = {"zero_optimization": zero, "communication_data_type": "fp32"}
    if bf16:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def accumulation_dtype(optimizer: Any) -> torch.dtype:
    """The dtype a ZeRO optimizer (or stage 1's BF16_Optimizer) accumulates and holds the gradients in."""
    for attr in ("gradient_accumulation_dtype", "grad_acc_dtype"):
        dtype = getattr(optimizer, attr, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise AssertionError(f"{type(optimizer).__name__} has no gradient accumulation dtype")


def fragment(param: torch.nn.Parameter) -> tuple[int, int]:
    """(start, numel) of the flattened parameter (this rank's TP shard) whose FP32 master and AdamW state this DP rank
    holds: stage 3's partition of the parameter, or stage 1/2's (and BF16_Optimizer's) fragment (0, 0 where the
    rank holds none of it)."""
    if hasattr(param, "ds_id"):  # stage 3: equal partitions of ds_numel, the last one padded
        part = int(param.ds_tensor.ds_numel)
        start = dist.get_rank(group=param.ds_process_group) * part
        return start, max(0, min(part, int(param.ds_numel) - start))
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return 0, 0
    address = mapping.lp_fragment_address
    return int(address.start), int(address.numel)


def incomplete_state(params: dict[str, torch.nn.Parameter], group: Any) -> dict[str, str]:
    """{name: why} for every parameter whose FP32 master and AdamW state the DP ranks' fragments do not cover exactly
    once (a collective of the DP group: every rank calls it with the same names)."""
    local = {name: fragment(p) for name, p in params.items()}
    gathered: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(gathered, local, group=group)
    out = {}
    for name, p in params.items():
        numel = int(getattr(p, "ds_numel", p.numel()))
        problem = coverage_problem([g[name] for g in gathered], numel)
        if problem:
            out[name] = problem
    return out
