"""The cross-rank contract of a case and its agreement check, run before any other collective.

Every rank of a TP x DP case holds a Contract: the numerical identity of the objective (algorithm, loss
normalizer, vocabulary and its padding, parallel layout, dtypes, logprob chunking, temperature, KL). Ranks
that disagree on any of it would compute different objectives for one model, or wait in collectives of
different shapes and hang. agree() has every rank take part in one all_gather_object of its fingerprint
and fields, so every rank sees the same table and either all return or all raise, naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from qualify.errors import QualifyError
from qualify.hashing import digest_of_bytes

ALGORITHMS = ("ppo", "grpo")
RANK_ORDERS = ("tp_major",)  # global rank = dp_rank * tp + tp_rank: TP siblings are adjacent ranks


class ContractMismatchError(QualifyError):
    """Ranks of one case hold different contracts, or claim an inconsistent TP x DP layout."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Contract:
    """What every rank of a case must agree on. Rank-local facts (own TP/DP rank) are not part of it."""

    algorithm: str
    """'ppo' or 'grpo'."""
    normalizer: str
    """the loss token normalizer or GRPO aggregation ('global', 'token_mean', 'seq_mean_token_sum_norm', ...)."""
    normalizer_constant: float | None = None
    """the fixed divisor of a constant normalizer (Dr. GRPO), else None."""
    vocab_size: int
    """the model's real vocabulary size V."""
    padded_vocab_size: int
    """V rounded up for TP sharding; columns [V, Vpad) are padding, masked out of every softmax."""
    tp: int
    """tensor-parallel degree."""
    dp: int
    """data-parallel degree; world size = tp x dp."""
    rank_order: str = "tp_major"
    """how global ranks map to (dp_rank, tp_rank)."""
    param_dtype: str
    """dtype of the parameters in the forward ('bfloat16', 'float32')."""
    compute_dtype: str
    """dtype of the matmuls."""
    logprob_dtype: str = "float32"
    """dtype of the log_softmax and of everything after it."""
    logprob_chunk_tokens: int
    """tokens per chunk of the fp32 log_softmax."""
    vocab_tile_size: int | None = None
    """tile size of the deterministic vocab-parallel logprob, None when it is not used."""
    temperature: float
    """sampling temperature the logits are divided by (in fp32)."""
    kl_coef: float = 0.0
    """coefficient of the KL-to-reference term."""
    kl_estimator: str = "k1"
    """'k1', 'k2' or 'k3'."""
    group_size: int = 1
    """GRPO responses per prompt (1 for PPO)."""
    pack_tokens: int | None = None
    """token budget of a packed micro-batch, None for padded batches: ranks that pack otherwise feed collectives of
    other shapes."""

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise QualifyError(f"algorithm {self.algorithm!r} is unknown; allowed: {', '.join(ALGORITHMS)}")
        if self.rank_order not in RANK_ORDERS:
            raise QualifyError(f"rank_order {self.rank_order!r} is unknown; allowed: {', '.join(RANK_ORDERS)}")
        if self.tp < 1 or self.dp < 1:
            raise QualifyError(f"tp and dp must be >= 1, got tp={self.tp}, dp={self.dp}")
        if not 0 < self.vocab_size <= self.padded_vocab_size:
            raise QualifyError(f"need 0 < vocab_size <= padded_vocab_size, got {self.vocab_size}, "
                             f"{self.padded_vocab_size}")
        if self.padded_vocab_size % self.tp:
            raise QualifyError(f"padded_vocab_size {self.padded_vocab_size} is not divisible by tp={self.tp}")
        if self.normalizer_constant is not None and not self.normalizer_constant > 0:
            raise QualifyError(f"normalizer_constant must be > 0 or None, got {self.normalizer_constant}")
        if self.logprob_chunk_tokens < 1 or self.group_size < 1:
            raise QualifyError("logprob_chunk_tokens and group_size must be >= 1")
        if self.vocab_tile_size is not None and (self.padded_vocab_size // self.tp) % self.vocab_tile_size:
            raise QualifyError(f"vocab_tile_size {self.vocab_tile_size} does not divide the TP shard width "
                             f"{self.padded_vocab_size // self.tp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def position(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of a global rank under rank_order."""
        assert 0 <= rank < self.world_size, (rank, self.world_size)
        return divmod(rank, self.tp)

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def canonical_json(self) -> str:
        """Sorted keys, no whitespace, floats as Python's shortest round-trip repr: one string per contract."""
        return json.dumps(self.fields(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    def fingerprint(self) -> str:
        """'sha256:<hex>' of canonical_json()."""
        return digest_of_bytes(self.canonical_json().encode("ascii"))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def disagreements(payloads: list[dict[str, Any]]) -> list[str]:
    """One line per field on which the gathered payloads differ, and per inconsistent rank position.

    payloads[r] is rank r's {'fingerprint', 'fields', 'position'}; a line reads
    "normalizer: 'token_mean' on ranks [0, 2], 'seq_mean_token_mean' on rank 1". Empty when all agree.
    """
    lines = []
    names = sorted({name for p in payloads for name in p["fields"]})
    for name in names:
        by_value: dict[str, list[int]] = {}
        for rank, p in enumerate(payloads):
            by_value.setdefault(repr(p["fields"].get(name, "<missing>")), []).append(rank)
        if len(by_value) > 1:
            lines.append(f"{name}: " + ", ".join(f"{v} on {_ranks(r)}" for v, r in by_value.items()))
    if not lines and len({p["fingerprint"] for p in payloads}) > 1:
        lines.append("fingerprint: the fields agree but the digests do not (a different qualify version?)")
    if not lines:
        contract = Contract(**payloads[0]["fields"])
        if contract.world_size != len(payloads):
            lines.append(f"layout: tp={contract.tp} x dp={contract.dp} = {contract.world_size} ranks, "
                         f"but {len(payloads)} ranks take part")
        else:
            for rank, p in enumerate(payloads):
                if p["position"] is not None and tuple(p["position"]) != contract.position(rank):
                    lines.append(f"layout: rank {rank} claims (dp_rank, tp_rank) = {tuple(p['position'])}, "
                                 f"{contract.rank_order} puts it at {contract.position(rank)}")
    return lines


def agree(contract: Contract, group=None, *, position: tuple[int, int] | None = None) -> str:
    """Check that every rank of group holds the same contract; returns the agreed fingerprint.

    Call it on every rank before any other collective of the case. It is one all_gather_object over
    gloo (a gloo group is made when the default backend has none; every rank makes it in the same call),
    so no rank can be left waiting: all ranks see the same gathered table and all return or all raise
    ContractMismatchError naming each differing field and the ranks on each side. position, when given,
    is this rank's (dp_rank, tp_rank), checked against the contract's rank_order. Ranks in the message are
    ranks of group.
    """
    import torch.distributed as dist

    if group is None and "gloo" not in dist.get_backend():
        group = dist.new_group(backend="gloo")
    payload = {"fingerprint": contract.fingerprint(), "fields": contract.fields(),
               "position": None if position is None else list(position)}
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, payload, group=group)
    lines = disagreements(gathered)
    if lines:
        raise ContractMismatchError("ranks disagree on the contract: " + "; ".join(lines))
    return payload["fingerprint"]
