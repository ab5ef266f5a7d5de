"""qualify.engines.sharded_state: torch FSDP2's AdamW state on real gloo ranks is sharded as its parameters and complete;
each way a state can be wrong (held whole, a rank's shard missing or of another size, a plain tensor) is named with
the parameter and the rank."""

from __future__ import annotations

import os

import pytest
import torch

from qualify.engines.sharded_state import check_sharded_state, tiling_problem
from tests.unit._ranks import spawn_ranks

BREAKS = ("none", "replicated", "absent_on_rank1", "short_shard_on_rank1", "plain")


def _break(kind: str, rank: int, p: torch.Tensor, state: dict) -> None:
    """Make p's exp_avg wrong in the way kind names (on every rank, or on rank 1 only)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    m = state[p]["exp_avg"]
    if kind == "replicated":  # the whole moment on every rank
        state[p]["exp_avg"] = m.redistribute(placements=[Replicate()])
    elif kind == "absent_on_rank1" and rank == 1:
        del state[p]["exp_avg"]
    elif kind == "short_shard_on_rank1" and rank == 1:  # claims the parameter's global shape, holds a row too few
        held = m.to_local()[:-1].clone()
        state[p]["exp_avg"] = DTensor.from_local(held, m.device_mesh, [Shard(0)], shape=m.shape, stride=m.stride())
    elif kind == "plain":
        state[p]["exp_avg"] = m.to_local().clone()


def _worker(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))  # 5 and 3 rows: uneven shards
        fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        named = dict(model.named_parameters())
        found = {}
        for kind in BREAKS:
            state = {p: dict(s) for p, s in opt.state.items()}
            _break(kind, rank, named["0.weight"], state)
            found[kind] = check_sharded_state(named, state)
        queue.put((rank, found))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def found():
    results = spawn_ranks(2, _worker, timeout=300)  # spawned interpreters import torch: slow on a busy machine
    assert results[0][1] == results[1][1]  # every rank reaches the same verdict
    return results[0][1]


def test_fsdp2_adamw_state_is_sharded_and_complete(found):
    assert found["none"] == []


@pytest.mark.parametrize(("kind", "message"), [
    ("replicated", ("exp_avg of 0.weight: rank 0 holds shape [5, 6] (Replicate(),) on mesh [2], its parameter shape "
                   "[5, 6] (Shard(dim=0),) on mesh [2]")),
    ("absent_on_rank1", "exp_avg of 0.weight: absent on rank 1"),
    ("short_shard_on_rank1", ("exp_avg of 0.weight: rank 1 holds a local shard of shape [1, 6], its placements give "
                             "[2, 6]")),
    ("plain", ("exp_avg of 0.weight: rank 0 holds a plain tensor of shape [3, 6], not a DTensor sharded as its "
              "parameter")),
])
def test_a_wrong_state_is_named(found, kind, message):
    assert found[kind] == [message]


def test_tiling_names_a_gap_an_overlap_and_a_stray_block():
    shape = (5, 6)
    assert tiling_problem(shape, [((0, 0), (3, 6)), ((3, 0), (2, 6)), ((3, 0), (2, 6))]) is None  # a replica: once
    assert tiling_problem(shape, [((0, 0), (3, 6)), ((3, 0), (0, 6))]) == "the ranks' blocks hold 18 of its 30 elements"
    assert tiling_problem(shape, [((0, 0), (3, 6)), ((2, 0), (3, 6))]) == "the blocks at [0, 0] and [2, 0] overlap"
    assert tiling_problem(shape, [((0, 0), (3, 6)), ((3, 0), (3, 6))]) == \
        "a block at [3, 0] of shape [3, 6] lies outside [5, 6]"
