"""qualify.manifest: what mutation testing found unpinned.

Refusal messages in full (the value they quote included), the checks reached only when the fast path
(_entry_ok) rejects an entry, a manifest without an 'evidence' hint, a manifest recreated inside its own
evidence, the canonical digest against a hand-written canonical text, and the report's JSON keys.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from qualify.errors import ManifestError
from qualify.manifest import (
    build_manifest,
    check_relative,
    create_manifest,
    digest_of,
    load_manifest,
    verify_manifest,
)
from qualify.store import write_json

GOOD_SHA = hashlib.sha256(b"a").hexdigest()


def manifest_with_entry(tmp_path: Path, entry: dict) -> Path:
    """A manifest of one (possibly bad) entry, its digest consistent, so only the entry is wrong."""
    document = {"schema": "qualify.manifest/1", "files": [entry]}
    document["digest"] = digest_of(document)
    path = tmp_path / "m.json"
    write_json(path, document)
    return path


def refusal(path: Path) -> str:
    with pytest.raises(ManifestError) as caught:
        load_manifest(path)
    return str(caught.value)


@pytest.mark.parametrize("entry, message", [
    ({"path": "a", "bytes": 0, "sha256": "xyz"},  # bytes 0 is allowed: the sha256 is what is wrong
     "files[0] (a): sha256 must be 64 lowercase hex digits, got 'xyz'"),
    ({"path": "a", "bytes": 1, "sha256": 123}, "files[0] (a): sha256 must be 64 lowercase hex digits, got 123"),
    ({"path": "a", "bytes": -3, "sha256": GOOD_SHA}, "files[0] (a): bytes must be an integer >= 0, got -3"),
    ({"path": "a", "bytes": 1.5, "sha256": GOOD_SHA}, "files[0] (a): bytes must be an integer >= 0, got 1.5"),
    ({"path": "a", "bytes": 1}, "files[0]: malformed entry {'bytes': 1, 'path': 'a'} (keys: bytes, path, sha256)"),
    ({"path": "a/../b", "bytes": 1, "sha256": GOOD_SHA},
     "files[0].path: manifest path escapes the evidence root, refusing: 'a/../b'"),
])
def test_entry_refusals_in_full(tmp_path, entry, message):
    path = manifest_with_entry(tmp_path, entry)
    assert refusal(path) == f"{path}: {message}"


def test_an_empty_file_entry_is_accepted(tmp_path):
    empty = hashlib.sha256(b"").hexdigest()
    path = manifest_with_entry(tmp_path, {"path": "e", "bytes": 0, "sha256": empty})
    assert load_manifest(path)["files"] == [{"path": "e", "bytes": 0, "sha256": empty}]


@pytest.mark.parametrize("bad", ["a\x00b", "\x00"])
def test_check_relative_refuses_a_nul(bad):
    with pytest.raises(ManifestError) as caught:
        check_relative(bad)
    assert str(caught.value) == f"manifest path is not a normalized POSIX path, refusing: {bad!r}"


def test_digest_is_sha256_of_the_canonical_text_without_the_digest():
    document = {"schema": "qualify.manifest/1", "files": [{"path": "a", "bytes": 1, "sha256": GOOD_SHA}],
                "evidence": "caf\u00e9", "digest": "sha256:ignored"}
    text = ('{"evidence":"caf\\u00e9","files":[{"bytes":1,"path":"a","sha256":"' + GOOD_SHA + '"}],'
            '"schema":"qualify.manifest/1"}')
    assert digest_of(document) == "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()


def test_a_manifest_without_an_evidence_hint_verifies_its_own_directory(tmp_path):
    evidence = tmp_path / "ev"
    evidence.mkdir()
    (evidence / "x").write_bytes(b"x")
    document = build_manifest(evidence, progress=False)
    assert "evidence" not in document
    write_json(evidence / "manifest.json", document)
    report = verify_manifest(evidence / "manifest.json", progress=False)
    assert report.ok and report.evidence == str(evidence.resolve()) and report.num_files == 1


def test_a_manifest_recreated_inside_its_evidence_does_not_list_itself(tmp_path):
    evidence = tmp_path / "ev"
    evidence.mkdir()
    (evidence / "x").write_bytes(b"x")
    first = create_manifest(evidence, evidence / "manifest.json", progress=False)
    again = create_manifest(evidence, evidence / "manifest.json", progress=False)  # the old manifest is there now
    assert [e["path"] for e in again["files"]] == ["x"] and again == first


def test_create_manifest_passes_jobs_and_progress_to_the_hashing(tmp_path, monkeypatch):
    from qualify import manifest

    calls = []
    real = manifest.hash_files

    def recording(root, paths, jobs=None, progress=True, *, sizes=None):
        calls.append((jobs, progress, sizes))
        return real(root, paths, jobs, False, sizes=sizes)

    monkeypatch.setattr(manifest, "hash_files", recording)
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "x").write_bytes(b"x")
    create_manifest(tmp_path / "ev", tmp_path / "m.json")
    create_manifest(tmp_path / "ev", tmp_path / "m.json", jobs=3, progress=False)
    build_manifest(tmp_path / "ev")
    # a bar by default (drawn only on a terminal, for long runs); the scanned sizes, not a second stat per file
    assert calls == [(None, True, {"x": 1}), (3, False, {"x": 1}), (None, True, {"x": 1})]


def test_report_json_says_whether_it_was_partial(tmp_path):
    evidence = tmp_path / "ev"
    evidence.mkdir()
    (evidence / "x").write_bytes(b"x")
    (evidence / "y").write_bytes(b"y")
    create_manifest(evidence, tmp_path / "m.json", progress=False)
    os.remove(evidence / "y")
    full = verify_manifest(tmp_path / "m.json", progress=False)
    part = verify_manifest(tmp_path / "m.json", progress=False, partial=True)
    assert (full.ok, part.ok) == (False, True)
    assert full.to_json()["partial"] is False and part.to_json()["partial"] is True
    assert part.to_json() == {"manifest": str(tmp_path / "m.json"), "evidence": str(evidence.resolve()),
                              "num_files": 2, "ok": True, "partial": True, "missing": ["y"], "extra": [],
                              "modified": [], "renamed": [], "problems": []}


def test_a_duplicate_is_named_where_it_repeats(tmp_path):
    entries = [{"path": p, "bytes": 1, "sha256": GOOD_SHA} for p in ("a", "b", "a")]
    document = {"schema": "qualify.manifest/1", "files": entries}
    document["digest"] = digest_of(document)
    path = tmp_path / "m.json"
    write_json(path, document)
    assert refusal(path) == f"{path}: files[2]: duplicate path 'a'"


def test_the_fast_path_and_the_full_check_disagreeing_is_an_assertion_naming_the_entry(tmp_path, monkeypatch):
    from qualify import manifest

    entry = {"bytes": 1, "path": "a", "sha256": GOOD_SHA}  # as read back: the manifest's keys are sorted
    path = manifest_with_entry(tmp_path, entry)
    monkeypatch.setattr(manifest, "_entry_ok", lambda e: False)  # a fast path that wrongly rejects a good entry
    with pytest.raises(AssertionError) as caught:
        load_manifest(path)
    assert str(caught.value) == f"_entry_ok and _check_entry disagree on {entry!r}"


def test_verify_manifest_draws_a_bar_by_default_and_passes_jobs(tmp_path, monkeypatch):
    from qualify import manifest

    calls = []
    real = manifest.start_hashing

    def recording(root, paths, sizes, *, jobs=None, progress=True):
        calls.append((jobs, progress))
        return real(root, paths, sizes, jobs=jobs, progress=False)

    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "x").write_bytes(b"x")
    create_manifest(tmp_path / "ev", tmp_path / "m.json", progress=False)
    monkeypatch.setattr(manifest, "start_hashing", recording)
    assert verify_manifest(tmp_path / "m.json").ok
    assert verify_manifest(tmp_path / "m.json", jobs=2, progress=False).ok
    assert calls == [(None, True), (2, False)]
