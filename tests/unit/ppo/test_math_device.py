"""The PPO math builds its helper tensors on the inputs' device (a CUDA mask needs CUDA positions); its refusals.

Checked on torch's 'meta' device, which exists everywhere: a position tensor made on the CPU instead
does not mix with a meta (or CUDA) mask, while the right code runs and keeps every shape.
"""

from __future__ import annotations

import torch

from qualify.ppo.math import last_active_index, token_rewards


def test_positions_follow_the_mask_to_its_device():
    mask_BT = torch.tensor([[True, True, False], [False, False, False]]).to("meta")
    index_B, has_any_B = last_active_index(mask_BT)
    assert (index_B.device.type, index_B.shape, has_any_B.shape) == ("meta", (2,), (2,))
    logp_BT = torch.zeros(2, 3, device="meta")
    rewards_BT = token_rewards(torch.zeros(2, device="meta"), logp_BT, logp_BT, mask_BT, 0.1)
    assert (rewards_BT.device.type, rewards_BT.shape) == ("meta", (2, 3))


def test_masked_mean_refusals_say_what_is_allowed():
    import pytest

    from qualify.ppo.math import masked_mean

    x_BT, mask_BT = torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError) as caught:
        masked_mean(x_BT, mask_BT, "mean")
    assert str(caught.value) == "unknown normalizer 'mean'; known: global, per_sequence, constant"
    for normalizer, constant in (("constant", None), ("global", 2.0)):
        with pytest.raises(ValueError) as caught:
            masked_mean(x_BT, mask_BT, normalizer, constant)
        assert str(caught.value) == "constant is required with normalizer 'constant' and only then"
    with pytest.raises(ValueError) as caught:
        masked_mean(x_BT, mask_BT, "constant", 0.0)
    assert str(caught.value) == "constant must be > 0, got 0.0"
