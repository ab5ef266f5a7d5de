"""The PPO math builds its helper tensors on the inputs' device (a CUDA mask needs CUDA positions).

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
