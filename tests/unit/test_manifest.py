"""Manifests: every tamper case is caught by verify_manifest and by `qualify verify`; bad input is refused."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qualify.cli.app import app
from qualify.errors import ManifestError
from qualify.manifest import (
    CHUNK_BYTES,
    build_manifest,
    check_relative,
    create_manifest,
    digest_of,
    hash_files,
    list_files,
    load_manifest,
    sha256_file,
    verify_manifest,
)
from qualify.store import read_json, write_json

FILES = {
    "a.json": b'{"a": 1}\n',
    "empty.txt": b"",
    "sub/b.bin": bytes(range(256)) * 40,
    "sub/deeper/c.safetensors": os.urandom(5000),
}


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """An evidence directory and its manifest (outside it)."""
    evidence = tmp_path / "evidence"
    for rel, data in FILES.items():
        (evidence / rel).parent.mkdir(parents=True, exist_ok=True)
        (evidence / rel).write_bytes(data)
    manifest = tmp_path / "manifest.json"
    create_manifest(evidence, manifest, progress=False)
    return evidence, manifest


def cli(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def flip_byte(evidence: Path) -> None:
    path = evidence / "sub/b.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(evidence: Path) -> None:
    path = evidence / "sub/deeper/c.safetensors"
    os.truncate(path, path.stat().st_size // 2)


TAMPERS: dict[str, tuple[Callable[[Path], None], dict[str, list]]] = {
    "flipped byte": (flip_byte, {"modified": ["sub/b.bin"]}),
    "deleted": (lambda e: (e / "a.json").unlink(), {"missing": ["a.json"]}),
    "added": (lambda e: (e / "sub/new.txt").write_text("new"), {"extra": ["sub/new.txt"]}),
    "renamed": (lambda e: (e / "sub/b.bin").rename(e / "sub/b2.bin"),
                {"missing": ["sub/b.bin"], "extra": ["sub/b2.bin"], "renamed": [("sub/b.bin", "sub/b2.bin")]}),
    "truncated": (truncate, {"modified": ["sub/deeper/c.safetensors"]}),
    "emptied file grows": (lambda e: (e / "empty.txt").write_bytes(b"\0"), {"modified": ["empty.txt"]}),
}


def test_untouched_tree_verifies(tree):
    evidence, manifest = tree
    report = verify_manifest(manifest, evidence, progress=False)
    assert report.ok and report.num_files == len(FILES)
    assert [e["path"] for e in read_json(manifest)["files"]] == sorted(FILES)
    result = cli("verify", str(manifest), "--evidence", str(evidence))
    assert result.exit_code == 0, result.output
    assert "OK 4 of 4 files" in result.stdout


@pytest.mark.parametrize("name", TAMPERS)
def test_tamper_is_reported_by_library_and_cli(tree, name):
    evidence, manifest = tree
    tamper, expected = TAMPERS[name]
    tamper(evidence)
    report = verify_manifest(manifest, evidence, progress=False)
    assert not report.ok
    assert report.missing == expected.get("missing", [])
    assert report.extra == expected.get("extra", [])
    assert [m.path for m in report.modified] == expected.get("modified", [])
    assert report.renamed == expected.get("renamed", [])
    for m in report.modified:
        original = FILES[m.path]
        assert (m.expected_bytes, m.expected_sha256) == (len(original), hashlib.sha256(original).hexdigest())
        current = (evidence / m.path).read_bytes()
        assert (m.actual_bytes, m.actual_sha256) == (len(current), hashlib.sha256(current).hexdigest())

    result = cli("verify", str(manifest), "--evidence", str(evidence))
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    for kind in ("missing", "extra", "modified"):
        for path in expected.get(kind, []):
            assert any(line.split()[:2] == [kind, path] for line in lines), (kind, path, lines)
    for old, new in expected.get("renamed", []):
        assert f"renamed  {old} -> {new}" in result.stdout
    assert lines[-1].startswith("FAILED")


def test_flipped_byte_keeps_size_and_says_sha(tree):
    evidence, manifest = tree
    flip_byte(evidence)
    [m] = verify_manifest(manifest, evidence, progress=False).modified
    assert m.expected_bytes == m.actual_bytes and m.expected_sha256 != m.actual_sha256
    assert "sha256 " in cli("verify", str(manifest), "--evidence", str(evidence)).stdout


def test_json_format_lists_everything(tree):
    evidence, manifest = tree
    flip_byte(evidence)
    (evidence / "a.json").unlink()
    (evidence / "sub/deeper/c.safetensors").rename(evidence / "moved.safetensors")
    (evidence / "brand-new").write_bytes(b"x")
    result = cli("verify", str(manifest), "--evidence", str(evidence), "--format", "json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and doc["num_files"] == len(FILES)
    assert doc["missing"] == ["a.json", "sub/deeper/c.safetensors"]
    assert doc["extra"] == ["brand-new", "moved.safetensors"]
    assert [m["path"] for m in doc["modified"]] == ["sub/b.bin"]
    assert set(doc["modified"][0]) == {"path", "expected_bytes", "actual_bytes", "expected_sha256", "actual_sha256"}
    assert doc["renamed"] == [{"from": "sub/deeper/c.safetensors", "to": "moved.safetensors"}]
    assert doc["manifest"] == str(manifest) and doc["evidence"] == str(evidence)


def test_json_format_when_ok(tree):
    evidence, manifest = tree
    result = cli("verify", str(manifest), "--evidence", str(evidence), "--format", "json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["ok"] is True and doc["missing"] == doc["extra"] == doc["modified"] == doc["renamed"] == []


def test_evidence_defaults_to_the_one_the_manifest_names(tree, monkeypatch, tmp_path):
    evidence, manifest = tree
    assert read_json(manifest)["evidence"] == "evidence"
    monkeypatch.chdir(evidence / "sub")  # the hint is relative to the manifest, not to the cwd
    assert verify_manifest(manifest, progress=False).ok
    assert cli("verify", str(manifest)).exit_code == 0


def test_manifest_inside_its_evidence_is_not_listed(tmp_path):
    evidence = tmp_path / "ev"
    evidence.mkdir()
    (evidence / "x").write_text("x")
    document = create_manifest(evidence, evidence / "manifest.json", progress=False)
    assert [e["path"] for e in document["files"]] == ["x"] and document["evidence"] == "."
    assert verify_manifest(evidence / "manifest.json", progress=False).ok


def rewrite(manifest: Path, edit: Callable[[dict], None], *, redigest: bool = True) -> None:
    """Edit a manifest; with redigest the digest is made consistent, so only the edit is wrong."""
    document = read_json(manifest)
    edit(document)
    if redigest:
        document["digest"] = digest_of(document)
    write_json(manifest, document)


def set_first_path(path: str) -> Callable[[dict], None]:
    def edit(document: dict) -> None:
        document["files"][0]["path"] = path
    return edit


def assert_refused(manifest: Path, evidence: Path, *words: str) -> None:
    """Refused by the library (ManifestError) and by the CLI (exit 2, one line naming words)."""
    with pytest.raises(ManifestError) as info:
        verify_manifest(manifest, evidence, progress=False)
    for word in words:
        assert word in str(info.value)
    result = cli("verify", str(manifest), "--evidence", str(evidence))
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("qualify: error: "), lines
    for word in words:
        assert word in lines[0]


@pytest.mark.parametrize("bad, reason", [
    ("../x", "escapes"),
    ("sub/../../x", "escapes"),
    ("/etc/passwd", "absolute"),
    ("./a.json", "normalized"),
    ("sub//b.bin", "normalized"),
    ("sub/b.bin/", "normalized"),
    (".", "normalized"),
    ("sub\\b.bin", "normalized"),
    ("", "non-empty"),
])
def test_path_traversal_in_an_entry_is_refused(tree, bad, reason):
    evidence, manifest = tree
    rewrite(manifest, set_first_path(bad))
    assert_refused(manifest, evidence, reason, repr(bad))


@pytest.mark.parametrize("field, value, words", [
    ("bytes", "12", ("bytes must be an integer",)),
    ("bytes", -1, ("bytes must be an integer",)),
    ("bytes", True, ("bytes must be an integer",)),
    ("sha256", "AB" * 32, ("64 lowercase hex",)),
    ("sha256", "ab" * 31, ("64 lowercase hex",)),
    ("path", 7, ("non-empty string",)),
])
def test_malformed_entry_is_refused(tree, field, value, words):
    evidence, manifest = tree

    def edit(document: dict) -> None:
        document["files"][0][field] = value
    rewrite(manifest, edit)
    assert_refused(manifest, evidence, *words)


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["files"].append(dict(d["files"][0])), ("duplicate path", "'a.json'")),
    (lambda d: d["files"][0].update(extra=1), ("malformed entry",)),
    (lambda d: d.pop("files"), ("no 'files' list",)),
    (lambda d: d.pop("schema"), ("no 'schema' string",)),
    (lambda d: d.update(evidence=3), ("'evidence' must be a path string",)),
])
def test_malformed_manifest_is_refused(tree, edit, words):
    _, manifest = tree
    rewrite(manifest, edit)
    with pytest.raises(ManifestError) as info:
        verify_manifest(manifest, None, progress=False)
    assert all(w in str(info.value) for w in words), str(info.value)
    result = cli("verify", str(manifest))
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1


def test_hand_edited_manifest_is_refused(tree):
    evidence, manifest = tree
    flip_byte(evidence)  # someone changes the evidence, then "fixes" the manifest by hand
    current = hashlib.sha256((evidence / "sub/b.bin").read_bytes()).hexdigest()

    def edit(document: dict) -> None:
        [entry] = [e for e in document["files"] if e["path"] == "sub/b.bin"]
        entry["sha256"] = current
    rewrite(manifest, edit, redigest=False)
    assert_refused(manifest, evidence, "digest does not match", str(manifest))


def test_malformed_json_manifest_is_refused(tree, tmp_path):
    evidence, _ = tree
    bad = tmp_path / "bad.json"
    bad.write_text('{"files": [')
    assert_refused(bad, evidence, "malformed JSON", str(bad))
    nan = tmp_path / "nan.json"
    nan.write_text('{"schema": "qualify.manifest/1", "files": [], "x": NaN, "digest": "sha256:0"}')
    assert_refused(nan, evidence, "not canonical JSON")
    assert_refused(tmp_path / "absent.json", evidence, "missing file")
    assert_refused(tmp_path, evidence, "cannot read")  # a directory given as the manifest


@pytest.mark.parametrize("make_link", [
    lambda e: os.symlink(e / "a.json", e / "sub/link.json"),
    lambda e: os.symlink(e / "sub", e / "linked-dir"),
    lambda e: os.symlink("/etc/passwd", e / "sub/deeper/outside"),
    lambda e: os.symlink(e / "nowhere", e / "dangling"),
], ids=["file", "directory", "outside", "dangling"])
def test_symlink_in_evidence_is_refused(tree, make_link):
    evidence, manifest = tree
    make_link(evidence)
    assert_refused(manifest, evidence, "refusing symlink in evidence")
    with pytest.raises(ManifestError, match="refusing symlink"):
        build_manifest(evidence, progress=False)


def test_symlinked_manifest_is_refused(tree, tmp_path):
    evidence, manifest = tree
    link = tmp_path / "link.json"
    link.symlink_to(manifest)
    assert_refused(link, evidence, "refusing symlinked manifest", str(link))


def test_special_file_in_evidence_is_refused(tree):
    evidence, manifest = tree
    os.mkfifo(evidence / "pipe")
    assert_refused(manifest, evidence, "refusing special file", "pipe")


def test_sha256_file_refuses_a_symlink_and_a_fifo(tmp_path):
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ManifestError, match="symlink"):
        sha256_file(tmp_path / "link")
    with pytest.raises(ManifestError, match="special file"):
        sha256_file(tmp_path / "fifo")  # O_NONBLOCK: refused, not a hang


def test_evidence_root_must_be_a_directory(tree, tmp_path):
    _, manifest = tree
    assert_refused(manifest, tmp_path / "absent", "evidence root is not a directory")


def test_large_file_is_streamed_and_hashed_like_hashlib(tmp_path):
    data = os.urandom(3 * CHUNK_BYTES + 12345)
    path = tmp_path / "large.bin"
    path.write_bytes(data)
    chunks: list[int] = []
    size, digest = sha256_file(path, chunks.append)
    assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest())
    assert len(chunks) >= 4 and max(chunks) <= CHUNK_BYTES and sum(chunks) == len(data)  # bounded reads
    assert hash_files(tmp_path, ["large.bin"], jobs=2, progress=False) == {"large.bin": (size, digest)}


@pytest.fixture
def many_files(tmp_path: Path) -> Path:
    """Mixed sizes so that batching, largest-first scheduling and several threads all take part."""
    root = tmp_path / "many"
    for i in range(300):
        path = root / f"d{i % 7}" / f"f{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom((i * 997) % 20000))
    for i in range(3):
        (root / f"big{i}.bin").write_bytes(os.urandom(CHUNK_BYTES + i * 4097))
    return root


def test_parallel_and_serial_hashing_agree(many_files):
    paths = list_files(many_files)
    serial = hash_files(many_files, paths, jobs=1, progress=False)
    parallel = hash_files(many_files, paths, jobs=4, progress=False)
    assert serial == parallel and list(parallel) == paths  # same values, in the order asked for
    for rel in paths[::37]:
        data = (many_files / rel).read_bytes()
        assert serial[rel] == (len(data), hashlib.sha256(data).hexdigest())
    assert build_manifest(many_files, jobs=1, progress=False) == build_manifest(many_files, jobs=4, progress=False)


def test_cli_jobs_1_and_4_report_the_same(many_files, tmp_path):
    manifest = tmp_path / "many.json"
    assert cli("manifest", "create", str(many_files), "--out", str(manifest), "--jobs", "4").exit_code == 0
    (many_files / "d3/f003.bin").write_bytes(b"changed")
    (many_files / "d0/f000.bin").unlink()
    outputs = [cli("verify", str(manifest), "--format", "json", "--jobs", j) for j in ("1", "4")]
    assert [r.exit_code for r in outputs] == [1, 1]
    assert outputs[0].stdout == outputs[1].stdout
    doc = json.loads(outputs[0].stdout)
    assert doc["missing"] == ["d0/f000.bin"] and [m["path"] for m in doc["modified"]] == ["d3/f003.bin"]


def test_manifest_document_is_sorted_and_self_digesting(tree):
    _, manifest = tree
    document = load_manifest(manifest)
    assert document["digest"] == digest_of(document)
    assert document["schema"] == "qualify.manifest/1"
    text = manifest.read_text()
    assert text == json.dumps(document, sort_keys=True, indent=2) + "\n"


def test_check_relative_accepts_plain_relative_paths():
    for good in ("a", "a/b", "reference/fp32-0/actor/grads.safetensors", ".hidden", "a..b", "..."):
        assert check_relative(good) == good


def test_unusual_but_valid_names_round_trip(tmp_path):
    evidence = tmp_path / "ev"
    names = [".hidden", "a..b", "...", "..x", "sp ace", "new\nline", "caf\u00e9", "[bold]x"]
    for name in names:
        (evidence / "d" / name).parent.mkdir(parents=True, exist_ok=True)
        (evidence / "d" / name).write_text(name)
    manifest = tmp_path / "m.json"
    document = create_manifest(evidence, manifest, progress=False)
    assert sorted(e["path"] for e in document["files"]) == sorted(f"d/{n}" for n in names)
    assert load_manifest(manifest) == document
    assert verify_manifest(manifest, progress=False).ok


def test_many_small_files_through_worker_processes(tmp_path, monkeypatch):
    """`qualify verify --jobs 2` on many small files hands them to worker processes."""
    from qualify import hashing

    monkeypatch.setattr(hashing, "MIN_SPAWN_FILES", 100)  # the real threshold takes 2000 files: slow to make
    evidence = tmp_path / "ev"
    for i in range(150):
        path = evidence / f"d{i % 10}" / f"f{i:05d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(i.to_bytes(4, "little") * 8)
    manifest = tmp_path / "m.json"
    create_manifest(evidence, manifest, jobs=1, progress=False)  # threads only: a reference for the workers
    assert cli("verify", str(manifest), "--jobs", "2").exit_code == 0
    (evidence / "d3/f00013").write_bytes(b"tampered")
    result = cli("verify", str(manifest), "--jobs", "2", "--format", "json")
    assert result.exit_code == 1
    assert [m["path"] for m in json.loads(result.stdout)["modified"]] == ["d3/f00013"]


def test_a_symlinked_evidence_directory_named_by_the_manifest_is_refused(tmp_path):
    """The evidence root a manifest names ('evidence': '../reference') may not be a link to another run's."""
    from qualify.manifest import verify_manifest

    real = tmp_path / "other" / "reference"
    for rel, data in FILES.items():
        (real / rel).parent.mkdir(parents=True, exist_ok=True)
        (real / rel).write_bytes(data)
    run = tmp_path / "run"
    (run / "acceptance").mkdir(parents=True)
    (run / "reference").symlink_to(real, target_is_directory=True)
    manifest = run / "acceptance" / "manifest.json"
    write_json(manifest, build_manifest(real, progress=False, extra={"evidence": "../reference"}))
    with pytest.raises(ManifestError, match="refusing symlinked evidence directory"):
        verify_manifest(manifest, progress=False)
