"""The cross-rank contract of a candidate case (qualify.contract), agreed by every rank before the case's first
collective: a rank launched with another normalizer, vocabulary, layout or precision stops the case with a message
naming the field and the ranks on each side, instead of computing another objective or hanging in a collective."""

from __future__ import annotations

from typing import Any

from qualify.contract import Contract, agree

COMPUTE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def case_contract(spec: Any) -> Contract:
    """The contract a case's spec declares: algorithm and normalizer (GRPO's aggregation and constant, or PPO's token
    normalizer), vocabulary (padded to a multiple of TP), TP x DP layout, dtypes, logprob chunking, temperature, KL,
    packing budget."""
    grpo, ppo = spec.grpo, spec.ppo
    vocab = spec.vocab_size
    return Contract(
        algorithm="ppo" if grpo is None else "grpo",
        normalizer=ppo.token_normalizer if grpo is None else grpo.aggregation,
        normalizer_constant=ppo.normalizer_constant if grpo is None else grpo.constant,
        vocab_size=vocab, padded_vocab_size=-(-vocab // spec.tp) * spec.tp, tp=spec.tp, dp=spec.dp,
        param_dtype="float32", compute_dtype=COMPUTE_DTYPES[spec.precision],
        logprob_chunk_tokens=spec.logprob_chunk_tokens, vocab_tile_size=spec.vocab_tile, temperature=spec.temperature,
        kl_coef=ppo.kl_coef if grpo is None else grpo.kl_coef,
        kl_estimator="k1" if grpo is None else grpo.kl_estimator,
        group_size=1 if grpo is None else grpo.group_size, pack_tokens=spec.pack_tokens)


def agree_case(spec: Any, rank: int) -> str:
    """Every rank of the launch agrees on the case's contract (one all_gather_object); returns its fingerprint.
    Raises qualify.contract.ContractMismatchError on every rank when any field differs."""
    return agree(case_contract(spec), position=divmod(rank, spec.tp))
