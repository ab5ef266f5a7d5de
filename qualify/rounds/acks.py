"""Verification of the acknowledgments that the vLLM ranks return after an installation.

Each rank acknowledges with {"rank", "version", "tensors": {vLLM name: digest of what it holds}}.
An installation is accepted only when there is exactly one acknowledgment per rank 0..tp-1, each
for the installed version, each holding exactly the expected tensors with the expected digests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from qualify.hashing import DIGEST_PREFIX


def short(digest: str) -> str:
    return digest.removeprefix(DIGEST_PREFIX)[:12]


def ack_problems(acks: Sequence[Mapping[str, Any]], version: int,
                 expected: Sequence[Mapping[str, str]]) -> list[str]:
    """Every reason not to accept acks for `version` (empty: accepted); expected[r] is rank r's digests."""
    tp = len(expected)
    counts = Counter(a.get("rank") for a in acks)
    problems = [f"rank {r}: no acknowledgment" for r in range(tp) if counts[r] == 0]
    problems += [f"rank {r}: {n} acknowledgments (duplicate)" for r, n in sorted(counts.items(), key=str) if n > 1]
    problems += [f"acknowledgment from rank {r!r}, which is not a rank of TP{tp}" for r in counts
                 if r not in range(tp)]
    for ack in acks:
        r = ack.get("rank")
        if r not in range(tp) or counts[r] != 1:
            continue
        if ack.get("version") != version:
            problems.append(f"rank {r}: acknowledges version {ack.get('version')}, installed {version}")
        if ack.get("error"):
            problems.append(f"rank {r}: {ack['error']}")
        held, want = ack.get("tensors") or {}, expected[r]
        problems += [f"rank {r}: {n} missing" for n in sorted(set(want) - set(held))]
        problems += [f"rank {r}: {n} is not expected" for n in sorted(set(held) - set(want))]
        problems += [f"rank {r}: {n} holds {short(held[n])}, expected {short(want[n])}"
                     for n in sorted(set(held) & set(want)) if held[n] != want[n]]
    return problems
