"""qualify rounds' per-rank acknowledgment of a tied LM head (tie_word_embeddings, as Qwen3-0.6B): GPU vLLM 0.26 makes
a tied model's lm_head the embedding module itself (`self.lm_head = self.model.embed_tokens`), which named_modules()
lists once, as model.embed_tokens. The rank must still report lm_head.weight (the expected shards name it: see
qualify.rounds.shards), or every install of a tied model is refused with "lm_head.weight missing" (measured on one
H200, benchmarks/gpu-wide-exact.yaml, 2026-12-04, b3b7433)."""

from __future__ import annotations

import torch

from qualify.rounds.vllm_ext import held_tensors


class Body(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(11, 4)
        self.norm = torch.nn.LayerNorm(4)


class TiedLikeVllm026(torch.nn.Module):
    """The module tree of vLLM 0.26's Qwen3ForCausalLM with tie_word_embeddings: the head is the embedding module."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.model = Body()
        self.lm_head = self.model.embed_tokens if tied else torch.nn.Linear(4, 11, bias=False)


def test_a_tied_head_that_is_the_embedding_module_is_reported_as_lm_head_weight() -> None:
    model = TiedLikeVllm026(tied=True)
    assert "lm_head" not in dict(model.named_modules())  # why a lookup by module name cannot find it
    held = list(held_tensors(model))
    names = [n for n, _ in held]
    assert len(names) == len(set(names))
    tensors = dict(held)
    assert "lm_head.weight" in tensors
    assert torch.equal(tensors["lm_head.weight"], model.model.embed_tokens.weight.detach())


def test_an_untied_head_is_reported_once_as_its_own_parameter() -> None:
    model = TiedLikeVllm026(tied=False)
    held = list(held_tensors(model))
    assert [n for n, _ in held].count("lm_head.weight") == 1
    assert torch.equal(dict(held)["lm_head.weight"], model.lm_head.weight.detach())
