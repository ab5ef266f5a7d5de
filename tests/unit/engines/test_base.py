"""The built-in adapters' shared score() from full outputs (qualify.engines.base.OutputScoring): the scores are
qualify.models.hf's, and the hooks report the declared formula's logprobs and the actor's logits of the last call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qualify.engines.base import EngineContext, OutputScoring
from qualify.engines.deepspeed_engine import DeepSpeedEngine
from qualify.engines.megatron import MegatronEngine
from qualify.engines.torch_tp import TorchTPEngine
from qualify.matrix import Optimizer
from qualify.models.hf import logprobs_from_outputs, scores_from_outputs

V = 16


def scorer(role: str, formula: str = "full", top_k: int = -1) -> OutputScoring:
    s = OutputScoring()
    s.ctx = EngineContext(role=role, precision="fp32", tp=1, rank=0, device="cpu", model_dir=Path("."),
                          optimizer=Optimizer(), temperature=0.7, logprob_chunk_tokens=3, vocab_size=V,
                          work_dir=Path("."), logprob_formula=formula, top_k=top_k)
    return s


def outputs(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 5, width, generator=g, requires_grad=True), torch.randint(0, V, (2, 5), generator=g)


@pytest.mark.parametrize("engine", [TorchTPEngine, DeepSpeedEngine, MegatronEngine])
def test_every_built_in_adapter_scores_through_it(engine):
    assert issubclass(engine, OutputScoring)
    assert all(engine.__dict__.get(n) is None for n in ("logprobs", "logits", "scores_from"))


def test_actor_full_formula_scores_and_keeps_the_logits():
    s = scorer("actor")
    out_BTV, ids_BT = outputs(V)
    assert s.logprobs() is None and s.logits() is None  # before any score()
    scores_BT = s.scores_from(out_BTV, ids_BT)
    expected = scores_from_outputs("actor", out_BTV, ids_BT, 0.7, 3, V)
    torch.testing.assert_close(scores_BT, expected, rtol=0, atol=0)
    assert scores_BT.requires_grad and scores_BT.device.type == "cpu"
    assert s.logprobs() is None  # the full formula: score()'s own values are judged
    torch.testing.assert_close(s.logits(), out_BTV.detach(), rtol=0, atol=0)
    assert not s.logits().requires_grad


def test_actor_processed_formula_reports_its_own_logprobs():
    s = scorer("actor", formula="processed", top_k=4)
    out_BTV, ids_BT = outputs(V)
    s.scores_from(out_BTV, ids_BT)
    expected = logprobs_from_outputs(out_BTV.detach(), ids_BT, "processed", s.ctx.sampling(), 3, V)
    torch.testing.assert_close(s.logprobs(), expected, rtol=0, atol=0)
    assert not torch.equal(s.logprobs(), scores_from_outputs("actor", out_BTV, ids_BT, 0.7, 3, V).detach())


def test_critic_scores_values_and_keeps_no_logits():
    s = scorer("critic", formula="processed", top_k=4)
    out_BT1, ids_BT = outputs(1)
    scores_BT = s.scores_from(out_BT1, ids_BT)
    torch.testing.assert_close(scores_BT, scores_from_outputs("critic", out_BT1, ids_BT, 0.7, 3, V), rtol=0, atol=0)
    assert s.logprobs() is None and s.logits() is None
