"""The checks a matrix may waive by name (candidates.waive), and how a waived row reads and is found again.

A waiver is an engine's declaration, like candidates.determinism, rollout_exact and layout_invariant, so it is given
per engine (`waive: {engine: [check, ...]}`), not for the whole matrix: a matrix that qualifies a plugin without a
logits() hook beside torch-tp excuses that plugin alone, and a built-in engine that stopped giving its logits still
fails. It travels in the case's spec (qualify.case.spec), which the case's sealed meta.json records, so the judge
reads it from the evidence and `qualify report`, judging every case again, applies the waiver the case ran with and
no other; a changed waiver is a changed spec, and the case runs again.

A waived row passes (value 0, bound inf: nothing was judged) with metric WAIVED and a note that starts with what was
waived (waived_note); the reports list each waiver of a verdict beside its result (waivers_of, waiver_text). A check
that can be made is made whatever the matrix waives: the waiver applies only where the check could not be.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

WAIVABLE = {
    "sampler_derivation": "the actor's logprobs derived by the sampler formula from its own logits (the engine's "
                          "logits() hook): without the hook, its logprobs are judged only against the reference's bounds",
}
"""The checks a matrix may waive, by name, and what is given up when one is waived. A new waivable check adds its name
here; where it cannot be made and its engine's waiver names it, its judge writes a passing row with metric WAIVED and
waived_note."""
WAIVED = "waived"
"""The metric of a waived row."""
NOTE = re.compile(r"^waived: (?P<waiver>\S+ for engine \S+) \(candidates\.waive\): ")


def unknown_checks(checks: Iterable[str]) -> list[str]:
    """The names among checks that are not waivable (sorted)."""
    return sorted(set(checks) - set(WAIVABLE))


def waived_note(check: str, engine: str, why: str) -> str:
    """A waived row's note: what was waived, for which engine, by which field, and what could not be checked."""
    assert check in WAIVABLE, check
    return f"waived: {check} for engine {engine} (candidates.waive): {why}"


def waiver_of(row: dict[str, Any]) -> str | None:
    """'<check> for engine <engine>' of a waived row (a verdict row as JSON), None for any other row."""
    if row.get("metric") != WAIVED or not row.get("passed"):
        return None
    m = NOTE.match(str(row.get("note", "")))
    return None if m is None else m["waiver"]


def waivers_of(rows: Iterable[Any]) -> list[str]:
    """Every waiver a verdict's rows used, once each, sorted ('sampler_derivation for engine my.pkg:factory')."""
    return sorted({w for w in (waiver_of(r) for r in rows if isinstance(r, dict)) if w is not None})


def waiver_text(waivers: list[str]) -> str:
    """What a report writes beside a result: ' (waived: a for engine X; b for engine Y)', '' without waivers."""
    return f" (waived: {'; '.join(waivers)})" if waivers else ""
