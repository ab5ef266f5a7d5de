"""qualify.contract: the canonical fingerprint, the disagreement table, and agree() for real over gloo.

The multi-process tests spawn 2 or 3 CPU processes (torch.multiprocessing, spawn) that each call agree();
a rank launched with a different normalizer must make every rank raise, naming the field and the ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import pytest

from qualify.contract import Contract, ContractMismatchError, agree, disagreements
from qualify.errors import QualifyError
from tests.unit._ranks import spawn_ranks

BASE = {
    "algorithm": "grpo",
    "normalizer": "token_mean",
    "vocab_size": 250,
    "padded_vocab_size": 256,
    "tp": 1,
    "dp": 2,
    "param_dtype": "bfloat16",
    "compute_dtype": "bfloat16",
    "logprob_chunk_tokens": 64,
    "vocab_tile_size": 32,
    "temperature": 0.7,
    "kl_coef": 0.04,
    "kl_estimator": "k3",
    "group_size": 4,
}


def make(**overrides) -> Contract:
    return Contract(**{**BASE, **overrides})


def payload(contract: Contract, position=None) -> dict:
    return {"fingerprint": contract.fingerprint(), "fields": contract.fields(), "position": position}


# --- fingerprint ------------------------------------------------------------------------------------------------


def test_fingerprint_is_sha256_of_sorted_compact_json():
    contract = make()
    text = contract.canonical_json()
    assert text.startswith('{"algorithm":"grpo","compute_dtype":"bfloat16",') and " " not in text
    assert contract.fingerprint() == "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    # the same fields in another order give the same digest
    assert Contract(**dict(reversed(list(BASE.items())))).fingerprint() == contract.fingerprint()


CHANGES = {
    "algorithm": "ppo", "normalizer": "seq_mean_token_mean", "normalizer_constant": 8.0, "vocab_size": 249,
    "padded_vocab_size": 512, "tp": 2, "dp": 4, "param_dtype": "float32", "compute_dtype": "float32",
    "logprob_dtype": "float64", "logprob_chunk_tokens": 32, "vocab_tile_size": 64, "temperature": 0.70000001,
    "kl_coef": 0.0, "kl_estimator": "k1", "group_size": 8, "pack_tokens": 128,
}


def test_every_field_changes_the_fingerprint():
    names = {f.name for f in dataclasses.fields(Contract)} - {"rank_order"}  # one allowed value today
    assert names == set(CHANGES)
    for name, value in CHANGES.items():
        assert make(**{name: value}).fingerprint() != make().fingerprint(), name


@pytest.mark.parametrize(("overrides", "message"), [
    ({"algorithm": "dpo"}, "algorithm 'dpo' is unknown; allowed: ppo, grpo"),
    ({"tp": 0}, "tp and dp must be >= 1"),
    ({"vocab_size": 300}, "need 0 < vocab_size <= padded_vocab_size"),
    ({"tp": 3}, "padded_vocab_size 256 is not divisible by tp=3"),
    ({"normalizer_constant": 0.0}, "normalizer_constant must be > 0"),
    ({"tp": 4, "vocab_tile_size": 128}, "vocab_tile_size 128 does not divide the TP shard width 64"),
    ({"rank_order": "dp_major"}, "rank_order 'dp_major' is unknown"),
])
def test_invalid_contracts_are_refused(overrides, message):
    with pytest.raises(QualifyError, match=message.replace("(", r"\(")):
        make(**overrides)


# --- the disagreement table ---------------------------------------------------------------------------------------


def test_agreeing_payloads_give_no_lines():
    contract = make(tp=2, dp=2)
    assert disagreements([payload(contract, contract.position(r)) for r in range(4)]) == []


def test_a_differing_field_names_the_field_and_both_sides():
    lines = disagreements([payload(make()), payload(make(normalizer="seq_mean_token_mean")), payload(make())])
    assert lines == ["normalizer: 'token_mean' on ranks [0, 2], 'seq_mean_token_mean' on rank 1"]


def test_several_differing_fields_are_each_named():
    lines = disagreements([payload(make(temperature=1.0)), payload(make(kl_coef=0.1))])
    assert lines == ["kl_coef: 0.04 on rank 0, 0.1 on rank 1", "temperature: 1.0 on rank 0, 0.7 on rank 1"]


def test_layout_claims_are_checked():
    contract = make(tp=2, dp=1)
    assert disagreements([payload(contract, (0, 0)), payload(contract, (0, 0))]) == [
        "layout: rank 1 claims (dp_rank, tp_rank) = (0, 0), tp_major puts it at (0, 1)"]
    assert disagreements([payload(contract)]) == ["layout: tp=2 x dp=1 = 2 ranks, but 1 ranks take part"]


def test_mismatch_error_is_a_qualify_error():
    assert issubclass(ContractMismatchError, QualifyError)


# --- agree() over gloo, for real ----------------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, overrides: dict, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        contract = make(dp=world, **overrides.get(rank, {}))
        try:
            queue.put((rank, "ok", agree(contract, position=(rank, 0))))
        except ContractMismatchError as e:
            queue.put((rank, "mismatch", str(e)))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, overrides: dict) -> list[tuple]:
    return spawn_ranks(world, _worker, overrides)


@pytest.mark.parametrize("world", [2, 3])
def test_matching_contracts_agree(world):
    results = run_ranks(world, {})
    expected = make(dp=world).fingerprint()
    assert results == [(r, "ok", expected) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_with_another_normalizer_stops_every_rank(world):
    odd = world - 1
    results = run_ranks(world, {odd: {"normalizer": "seq_mean_token_sum_norm", "normalizer_constant": 64.0}})
    others = list(range(odd))
    side = f"rank {others[0]}" if len(others) == 1 else f"ranks {others}"
    for rank, status, message in results:
        assert status == "mismatch", (rank, message)
        assert f"normalizer: 'token_mean' on {side}, 'seq_mean_token_sum_norm' on rank {odd}" in message
        assert f"normalizer_constant: None on {side}, 64.0 on rank {odd}" in message
