"""The candidate stage's resume policy: what a sealed case must have been made with to be reused.

Each case's spec.json carries a resume key written before launch (its spec, the engine's code, the numerics packages'
versions, the acceptance's digest); a sealed case whose recorded key differs, or whose imported code
(qualify.candidate.imported) hashes otherwise now, is removed and run again, naming what changed.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from qualify.case.launch import write_spec_file
from qualify.case.spec import CaseSpec
from qualify.layout import RunLayout, work_dir
from qualify.matrix import Case
from qualify.stagelog import StageLog
from qualify.stages import stage_info, stage_is_complete
from qualify.store import read_json


def write_spec(spec: CaseSpec, doc: dict[str, Any]) -> Path:
    """The case's spec.json, with its resume key, in its work directory (next to the evidence directory, outside
    it)."""
    return write_spec_file(replace(spec, resume_key=resume_key(spec, doc)))


def resume_key(spec: Any, doc: dict[str, Any]) -> dict[str, str]:
    """What a complete case must have been made with to be reused: each part a digest, so a mismatch names it."""
    from qualify.engines.registry import engine_identity
    from qualify.stages import fingerprint
    from qualify.versions import dependency_versions

    versions = {k: v for k, v in dependency_versions().items() if k != "qualify"}
    return {"spec": fingerprint({k: v for k, v in spec.to_json().items() if k != "resume_key"}),
            "engine code": fingerprint(engine_identity(spec.engine)), "versions": fingerprint(versions),
            "acceptance": doc["digest"]}


def stale_reason(case_dir: Path, key: dict[str, str]) -> str | None:
    """Why a complete case may not be reused ('engine code changed', ...), or None when its key matches: the key made
    before launch, and the code the ranks imported (qualify.candidate.imported) hashed again now."""
    from qualify.candidate.imported import KEY, digest_now

    recorded = stage_info(case_dir).get("key") or {}
    now = key | {KEY: digest_now(work_dir(case_dir))}
    changed = [part for part in now if now[part] is None or recorded.get(part) != now[part]]
    return f"{', '.join(changed)} changed since it was sealed" if changed else None


def pending_cases(layout: RunLayout, cases: list[Case], specs_by_case: dict[Case, Path], log: StageLog) -> list[Case]:
    """The cases of a launch group that must run: those not sealed, and those sealed with a stale key (removed here,
    before any launch starts, so that a sealed case seen while the launches run is one of this run's or a fresh
    one). specs_by_case: each case's spec file (write_spec)."""
    pending = []
    for c in cases:
        if not stage_is_complete(layout.case(c.name)):
            pending.append(c)
            continue
        reason = stale_reason(layout.case(c.name), read_json(specs_by_case[c])["resume_key"])
        if reason is None:
            log.skip(f"case {c.name}")
            continue
        log.note(f"redo case {c.name}: {reason}")
        shutil.rmtree(layout.case(c.name))
        pending.append(c)
    return pending
