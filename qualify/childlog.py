"""One line out of a failed child process's output (the vLLM worker, a case's ranks).

A child that dies prints pages: log lines, a traceback, a wrapper exception that says "see root cause
above", warnings from process-group teardown. The user needs the one line that says what went wrong;
the whole output goes to a log file that the message names (the caller writes it). And whatever a
child, an engine or its log says is shown through printable: its control characters escaped.
"""

from __future__ import annotations

import re

MAX_SUMMARY = 300
"""Longest summary, in characters; a longer line is cut with '...'."""

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Prefixes that say who printed a line, not what it says: "(EngineCore_DP0 pid=123) ", "[rank0]: ",
# and vLLM's "ERROR 11-30 18:00:00 [core.py:708] " (level, date, time, source).
_PROCESS_TAG = re.compile(r"^\((?:[^()]*\s)?pid=\d+\)\s*")
_RANK_TAG = re.compile(r"^\[rank\d+\]:\s*")
_LOG_PREFIX = re.compile(r"^(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\s+\d\d-\d\d\s+[\d:.]+\s+\[[^\]]*\]\s*")
# "ValueError: ...", "torch.OutOfMemoryError: ...", "vllm.v1.engine.exceptions.EngineDeadError" alone.
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure)(?::\s*(.*))?$")
_GENERIC = ("see root cause above", "see the root cause above", "see stack trace above")
_NOISE_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN")
_FRAME_STARTS = ("Traceback (most recent call last)", 'File "', "^", "~", "The above exception",
                 "During handling of the above exception")


_CONTROL = "\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff\ufffe\uffff"
_UNPRINTABLE = re.compile(f"[\n{_CONTROL}]")
_UNPRINTABLE_BUT_NEWLINES = re.compile(f"[{_CONTROL}]")


def printable(text: str, newlines: bool = False) -> str:
    """A foreign string (an engine's exception, its log, a name it chose) made safe to show on a terminal, in a page
    or a CI log: every control character but the tab (ESC, BEL, CR, backspace, DEL, C1), bidirectional override and
    character XML cannot hold written as \\xNN or \\uNNNN, the newline too unless newlines=True (a caller that
    shows its own lines). The one function every message that quotes an engine goes through."""
    pattern = _UNPRINTABLE_BUT_NEWLINES if newlines else _UNPRINTABLE
    return pattern.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def _clean(line: str) -> tuple[str, str]:
    """(level, text): the line without colour codes and who-printed-it prefixes; level '' when it had none."""
    text = _ANSI.sub("", line).strip()
    text = _RANK_TAG.sub("", _PROCESS_TAG.sub("", text))
    match = _LOG_PREFIX.match(text)
    level = match.group(1) if match else ""
    return level, (text[match.end():] if match else text).strip()


def _is_frame(text: str) -> bool:
    """A traceback's scaffolding: its header, a 'File ...' line, or the source line and carets under it."""
    return text.startswith(_FRAME_STARTS)


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_SUMMARY else text[:MAX_SUMMARY - 3] + "..."


def summarize_child_failure(text: str) -> str:
    """The last meaningful error line of a child's output, on one line of at most MAX_SUMMARY characters.

    In order of preference: the last exception line that is not a generic wrapper ("... See root cause
    above"), the last exception line, the last ERROR/CRITICAL log line, the last line that is not log
    noise or traceback scaffolding, the last line; '(no output)' when the child printed nothing.
    """
    lines = [_clean(line) for line in text.splitlines()]
    lines = [(level, t) for level, t in lines if t]
    if not lines:
        return "(no output)"
    exceptions = [t for _, t in lines if _EXCEPTION.match(t)]
    specific = [t for t in exceptions if not any(g in t.lower() for g in _GENERIC)]
    if specific or exceptions:
        return _cut((specific or exceptions)[-1])
    errors = [t for level, t in lines if level in ("ERROR", "CRITICAL", "FATAL") and not _is_frame(t)]
    if errors:
        return _cut(errors[-1])
    plain = [t for level, t in lines if level not in _NOISE_LEVELS and not _is_frame(t)]
    return _cut((plain or [lines[-1][1]])[-1])


def child_failure_message(what: str, returncode: int, text: str, log_path: str) -> str:
    """One line for a QualifyError: what failed, its exit status, the summary, and where the whole output is."""
    return f"{what} failed (exit {returncode}): {printable(summarize_child_failure(text))} (full output: {log_path})"
