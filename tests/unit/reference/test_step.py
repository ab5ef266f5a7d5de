"""The HF reference step on a tiny model: micro-batch split equals the full batch, checkpointing is real,
rewards pool at the last response token, chunked logprobs feed the same loss."""

from __future__ import annotations

import pytest
import torch

from qualify.matrix import PPO, TinyModel
from qualify.models import hf
from qualify.models.tiny import build_tiny_model
from qualify.ppo.math import masked_gae, token_rewards
from qualify.ppo.share import count_normalizers
from qualify.reference.step import Control, _row_slices

SPEC = TinyModel(seed=7, vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2,
                 num_kv_heads=1, head_dim=32)


def batch(B=4, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 120, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 5:12] = True
    mask[1, 5:9] = True
    mask[2, 5:6] = True  # row 3: no response at all
    return ids, mask


@pytest.mark.parametrize("normalizer,constant", [("global", None), ("per_sequence", None), ("constant", 16.0)])
def test_microbatch_shares_sum_to_full_batch_loss(normalizer, constant):
    """Each micro-batch divides by the whole step's normalizers (as the reference's micro-batch control does): the
    shares sum to the full batch's loss and clip fraction (unequal active tokens and sequences per micro-batch)."""
    from qualify.ppo.math import clipped_value_loss

    _, mask = batch()
    g = torch.Generator().manual_seed(1)
    v, old, ret = (torch.randn(4, 12, generator=g) for _ in range(3))
    full, full_frac = clipped_value_loss(v, old, ret, mask, 0.2, normalizer, constant)
    total, frac = torch.zeros(()), torch.zeros(())
    for rows in _row_slices(4, 2):
        part, part_frac = clipped_value_loss(v[rows], old[rows], ret[rows], mask[rows], 0.2, normalizer, constant,
                                             normalizers=count_normalizers(mask))
        total, frac = total + part, frac + part_frac
    assert torch.allclose(total, full, rtol=1e-6, atol=1e-7) and torch.allclose(frac, full_frac, rtol=1e-6)


def test_reward_is_pooled_at_last_response_token_and_zero_without_response():
    model = build_tiny_model(SPEC, "reward")
    ids, mask = batch()
    scores = hf.reward_scores(model, ids, mask)
    with torch.no_grad():
        head = model(input_ids=ids).logits[..., 0]
    assert scores[0] == head[0, 11] and scores[1] == head[1, 8] and scores[2] == head[2, 5]
    assert scores[3] == 0.0
    rewards = token_rewards(scores, torch.zeros(4, 12), torch.zeros(4, 12), mask, 0.1)
    assert rewards[3].abs().sum() == 0  # no silent bootstrap or reward at position 0
    adv, ret = masked_gae(rewards, torch.ones(4, 12), mask, 1.0, 0.95)
    assert adv[3].abs().sum() == 0 and ret[3].abs().sum() == 0


def test_gradient_checkpointing_really_recomputes():
    model = build_tiny_model(SPEC, "actor")
    ids, _ = batch()
    calls = []
    # a pre-hook: non-reentrant recomputation stops early, right after the last saved tensor is remade
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    hf.actor_logprobs(model, ids, 0.8, 16, SPEC.vocab_size).sum().backward()
    plain = len(calls)
    calls.clear()
    model.zero_grad()
    hf.enable_checkpointing(model)
    hf.actor_logprobs(model, ids, 0.8, 16, SPEC.vocab_size).sum().backward()
    assert plain == 1 and len(calls) == 2  # the layer ran again in backward


def test_bf16_compute_copy_keeps_fp32_rope_and_rounds_master(tmp_path):
    model = build_tiny_model(SPEC, "actor")
    model.save_pretrained(tmp_path)
    master = hf.load_model(tmp_path, "actor")
    copy = hf.compute_copy(master, "bf16", tmp_path, "actor", "sdpa")
    assert copy.model.rotary_emb.inv_freq.dtype == torch.float32
    for mp, cp in zip(master.parameters(), copy.parameters()):
        assert cp.dtype == torch.bfloat16 and torch.equal(cp, mp.to(torch.bfloat16))
    assert Control(name="r0").microbatches == 1 and PPO().token_normalizer == "global"
