"""FSDP2 plugin engines with known data-parallel bugs, named in matrices as 'tests.integration.fsdp_plugins:<factory>'.

Each is the correct fsdp2 engine (qualify.engines.fsdp2) with one trap from the field put back in; qualification must
fail naming the tensor the bug changes (negative controls).
"""

from __future__ import annotations

import torch

from qualify.engines.fsdp2 import FSDP2Engine
from qualify.engines.torch_tp import grad_norm, local


class BF16ReducedGradients(FSDP2Engine):
    """MixedPrecisionPolicy(reduce_dtype=torch.bfloat16): every gradient is rounded to bf16 before the reduce-scatter
    and the DP partial sums are added in bf16 (what torchtitan's mixed_precision_reduce 'bfloat16' does); the sharded
    gradients are then cast to the FP32 masters' dtype, so their dtype still reads float32."""

    name = "fsdp2-bf16-reduce"
    reduce_dtype = torch.bfloat16


class LocalShardClipNorm(FSDP2Engine):
    """Takes the clip norm over this rank's local shards only (to_local(), no DTensor reduction): each DP rank clips
    with its own, too small norm and reports it as the global one."""

    name = "fsdp2-local-shard-norm"

    def grad_norm(self, grads):
        return grad_norm([local(g) for g in grads])


class StaleUnshardedParameters(FSDP2Engine):
    """FSDP2 as ZeRO-2 without its all-gather in the backward: reshard_after_forward False and
    set_reshard_after_backward(False), and no reshard() after the optimizer step. The modules stay unsharded, so every
    later forward and backward runs on the parameters gathered before the first step while AdamW steps the shards."""

    name = "fsdp2-stale-unsharded"

    def setup(self, ctx):
        super().setup(ctx)
        self.master.set_reshard_after_forward(False, recurse=True)
        self.master.set_reshard_after_backward(False, recurse=True)


def bf16_reduce() -> FSDP2Engine:
    return BF16ReducedGradients()


def local_shard_norm() -> FSDP2Engine:
    return LocalShardClipNorm()


def stale_unsharded() -> FSDP2Engine:
    return StaleUnshardedParameters()
