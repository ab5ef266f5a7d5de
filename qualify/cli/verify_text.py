"""What `qualify verify` says, as (style, tag, text) lines: one home for both of its renderers.

The Typer command prints them through rich (colours on a terminal); the fast path of a piped
`qualify verify` (qualify.cli.entry) prints them as plain text, which is what rich prints when
stdout is not a terminal. This module imports neither Typer nor rich.
"""

from __future__ import annotations

from typing import Any


def verify_lines(report: Any) -> list[tuple[str, str, str]]:
    """(style, tag, text) per line of a VerifyReport: OK (and the signature checked, if any), or every missing, extra,
    modified and renamed file and every other problem."""
    signature = getattr(report, "signature", None)
    if report.ok:
        present = report.num_files - len(report.missing)
        absent = f"; {len(report.missing)} absent from this partial copy" if report.missing else ""
        signed = [] if signature is None else [("green", "OK", (
            f"signature {signature['signature']}: a good signature of {signature['digest']} by {signature['signer']} "
            f"(namespace {signature['namespace']})"))]
        return [("green", "OK", (f"{present} of {report.num_files} files match {report.manifest} "
                                f"(evidence {report.evidence}{absent})")), *signed]
    # a partial copy lacks most files by design: what it must hold and lacks is among the problems
    lines = [] if report.partial else [("red", "missing ", path) for path in report.missing]
    lines += [("red", "extra   ", path) for path in report.extra]
    for m in report.modified:
        detail = (f"size {m.expected_bytes} -> {m.actual_bytes}" if m.expected_bytes != m.actual_bytes
                  else f"sha256 {m.expected_sha256[:12]} -> {m.actual_sha256[:12]}")
        lines.append(("red", "modified", f"{m.path} ({detail})"))
    lines += [("yellow", "renamed ", f"{old} -> {new} (same content)") for old, new in report.renamed]
    problems = getattr(report, "problems", [])
    lines += [("red", "problem ", text) for text in problems]
    lines.append(("bold red", "FAILED", (f"{len(report.missing)} missing, {len(report.extra)} extra, "
                                        f"{len(report.modified)} modified, {len(report.renamed)} renamed of "
                                        f"{report.num_files} files in {report.manifest}"
                                        + (f"; {len(problems)} other problem(s)" if problems else ""))))
    return lines
