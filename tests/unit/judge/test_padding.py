"""The harness finds vocabulary padding itself, and an engine that pads without reporting it fails."""

from __future__ import annotations

import torch

from qualify.judge.padding import exposed_rows, padding_found
from qualify.judge.steps import evidence_rows, unexposed_padding

VOCAB, HIDDEN, TP = 10, 4, 2


def checkpoint():
    g = torch.Generator().manual_seed(0)
    return {"lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g),
            "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(12, HIDDEN, generator=g)}


class Engine:
    """What an engine holds on one rank: a dict of master shards and a module."""

    def __init__(self, shards: dict[str, torch.Tensor]):
        self.master = shards
        self.module = torch.nn.Linear(HIDDEN, 3)


def shard(full: torch.Tensor, rank: int, rows: int) -> torch.Tensor:
    """Rows [rank * rows, (rank + 1) * rows) of full, zero rows beyond it (padding)."""
    out = torch.zeros(rows, full.shape[1])
    part = full[rank * rows:(rank + 1) * rows]
    out[:part.shape[0]] = part
    return out


def test_padded_shards_are_found_by_their_values_on_the_rank_that_holds_the_padding():
    ck = checkpoint()
    rows = 8  # padded vocabulary 16 = 8 x 2: rank 0 holds rows 0-7, rank 1 rows 8-9 and 6 padding rows
    for rank, expected in ((0, {}), (1, {"master.lm": 6, "master.emb": 6})):
        engine = Engine({"lm": shard(ck["lm_head.weight"], rank, rows),
                         "emb": shard(ck["model.embed_tokens.weight"], rank, rows),
                         "up": shard(ck["model.layers.0.mlp.up_proj.weight"], rank, 6)})
        assert padding_found(engine, ck, VOCAB, TP, rank) == expected


def test_even_shards_and_other_tensors_are_no_padding():
    ck = checkpoint()
    engine = Engine({"lm": ck["lm_head.weight"][5:], "noise": torch.randn(8, HIDDEN)})
    assert padding_found(engine, ck, VOCAB, TP, 1) == {}


def test_a_dtensor_like_local_shard_is_read_through_to_local():
    ck = checkpoint()

    local = shard(ck["lm_head.weight"], 1, 8)
    wrapper = torch.zeros(1)
    wrapper.to_local = lambda: local  # what a DTensor offers
    engine = Engine({"lm": wrapper})
    assert padding_found(engine, ck, VOCAB, TP, 1) == {"master.lm": 6}


def test_padding_not_reported_is_a_failing_evidence_row_naming_it():
    per_rank = [{"found": {}, "exposed": 0}, {"found": {"master.lm": 6, "master.emb": 6}, "exposed": 0}]
    assert unexposed_padding(per_rank)[0] == 12
    meta = {"grad_dtypes": {}, "state_dtypes": {}, "replica_max_abs": {}, "padded_rows": {}, "extra_params": [],
            "padding": per_rank}
    [row] = [r for r in evidence_rows("c", "actor", meta) if r.metric == "num_unexposed"]
    assert not row.passed and row.value == 12.0 and "rank 1: master.emb (6 rows), master.lm (6 rows)" in row.note
    reported = [per_rank[0], {"found": {"master.lm": 6, "master.emb": 6}, "exposed": exposed_rows(
        {"lm_head.weight": torch.zeros(6, HIDDEN), "model.embed_tokens.weight": torch.zeros(6, HIDDEN)})}]
    [row] = [r for r in evidence_rows("c", "actor", meta | {"padding": reported}) if r.metric == "num_unexposed"]
    assert row.passed and row.value == 0.0


# --- real DTensor shards on two gloo ranks -----------------------------------------------------------------------

REPEATS = 12
PADDED = 16  # VOCAB 10 padded to a multiple of 8 x TP: rank 1 holds rows 8-9 and 6 padding rows


class HidingEngine:
    """A TP2 engine as torch-tp would hold one, with its vocabulary padded: an embedding whose weight is a DTensor
    sharded by rows, the same DTensor again in a dict (a tied or registered alias), an fp32 master copy of each local
    shard, and padded_rows() that reports nothing (the padding is hidden)."""

    def __init__(self, ck: dict, mesh) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        self.module = torch.nn.Embedding(PADDED, HIDDEN)
        full = torch.zeros(PADDED, HIDDEN)
        full[:VOCAB] = ck["model.embed_tokens.weight"]
        self.module.weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        self.aliases = {"embed": self.module.weight}  # the same parameter reached a second way: one tensor
        self.master = {"embed": self.module.weight.to_local().detach().clone()}  # another tensor: counted apart

    def padded_rows(self) -> dict:
        return {}


def _padding_worker(rank: int, world: int, port: int, queue) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        engine = HidingEngine(checkpoint(), init_device_mesh("cpu", (world,)))
        answers = []
        for _ in range(REPEATS):  # temporaries made and freed between calls, as a worker's steps do
            answers.append(padding_found(engine, checkpoint(), VOCAB, world, rank))
            [engine.module.weight.to_local() * 1.0 for _ in range(3)]
        queue.put((rank, answers, exposed_rows(engine.padded_rows())))
    finally:
        dist.destroy_process_group()


def test_tp2_dtensor_padding_is_found_once_in_a_loop_and_hidden_padding_fails_by_name():
    from tests.unit._ranks import spawn_ranks

    results = spawn_ranks(2, _padding_worker, timeout=120)
    (_, rank0, _), (_, rank1, exposed1) = results
    assert rank0 == [{}] * REPEATS  # rank 0 holds rows 0-7: no padding
    # one answer every time: the DTensor reached through the module and the dict is one tensor, the master another
    assert rank1 == [{"aliases.embed": 6, "master.embed": 6}] * REPEATS
    per_rank = [{"found": rank0[0], "exposed": 0}, {"found": rank1[0], "exposed": exposed1}]
    meta = {"grad_dtypes": {}, "state_dtypes": {}, "replica_max_abs": {}, "padded_rows": {}, "extra_params": [],
            "padding": per_rank}
    [row] = [r for r in evidence_rows("c", "actor", meta) if r.metric == "num_unexposed"]
    assert not row.passed and row.value == 12.0
    assert "rank 1: aliases.embed (6 rows), master.embed (6 rows)" in row.note


def test_the_same_elements_reached_twice_are_one_tensor_and_distinct_tensors_two():
    ck = checkpoint()
    lm = shard(ck["lm_head.weight"], 1, 8)
    engine = Engine({"lm": lm, "tied": lm, "view": lm[:], "copy": lm.clone()})
    for _ in range(REPEATS):
        assert padding_found(engine, ck, VOCAB, TP, 1) == {"master.copy": 6, "master.lm": 6}
