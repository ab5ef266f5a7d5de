"""An engine whose forward is independent of the micro-batch layout by construction: torch-tp scoring each row on
its own (one forward per row), so no row's numbers depend on which rows share its batch or in which order.

Name it in a matrix as `qualify.examples.rowwise:engine` and declare it in `candidates.layout_invariant`: its layout
probe must then find every token bitwise the same in every layout (qualify.judge.layout_probe). It costs one
forward per row; the gradients are the batch's (the rows' losses are summed by the objective as usual). The vocab-
parallel path (candidates.vocab_tile) is torch-tp's own and is scored row by row the same way.
"""

from __future__ import annotations

import torch

from qualify.engines.base import Batch
from qualify.engines.torch_tp import TorchTPEngine


class RowwiseEngine(TorchTPEngine):
    """torch-tp, one forward per row."""

    name = "rowwise"

    def score(self, batch: Batch) -> torch.Tensor:
        scores, declared, logits = [], [], []
        for b in range(batch.input_ids_BT.shape[0]):
            row = batch.rows(slice(b, b + 1))
            scores.append(super().score(row))
            declared.append(self.declared_BT)
            logits.append(self.last_logits)
        # the hooks give the whole batch's, row by row as scored
        self.declared_BT = None if any(d is None for d in declared) else torch.cat(declared)
        self.last_logits = None if any(x is None for x in logits) else torch.cat(logits)
        return torch.cat(scores)


def engine() -> RowwiseEngine:
    return RowwiseEngine()
