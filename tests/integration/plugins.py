"""Plugin engines with known bugs, named in matrices as 'tests.integration.plugins:<factory>'.

Each is the correct torch-tp engine with one trap from the field put back in. Qualification
must fail for every one of them (negative controls).
"""

from __future__ import annotations

import torch

from qualify.engines.common import score_from_logits
from qualify.engines.torch_tp import TorchTPEngine, local


class SkipNormAllreduce(TorchTPEngine):
    """Forgets that q_norm/k_norm gradients are partial sums under TP (no all-reduce)."""

    name = "skip-norm-allreduce"
    grad_allreduce_suffixes = ()


class LowPrecisionTemperature(TorchTPEngine):
    """Holds the temperature as a bf16 tensor: bf16 logits are divided by a bf16 temperature, and
    fp32 logits by bf16(T) (0.80078125 for 0.8): wrong whenever T is not exactly representable."""

    name = "bf16-temperature"

    def score(self, batch):
        ids_BT = batch.input_ids_BT.to(self.ctx.device)
        logits_BTV = local(self.compute(input_ids=ids_BT, use_cache=False).logits)
        if self.ctx.role != "actor":
            return super().score(batch)
        scaled_BTV = logits_BTV / torch.tensor(self.ctx.temperature, dtype=torch.bfloat16)
        return score_from_logits("actor", scaled_BTV, ids_BT, 1.0, self.ctx.logprob_chunk_tokens,
                                 self.ctx.vocab_size).cpu()


def skip_norm_allreduce() -> TorchTPEngine:
    return SkipNormAllreduce()


def bf16_temperature() -> TorchTPEngine:
    return LowPrecisionTemperature()
