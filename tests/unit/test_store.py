"""The evidence store: atomic writes leave no temp file behind, JSON is canonical, safetensors round-trips."""

from __future__ import annotations

import json
import os
import re
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from qualify.errors import EvidenceError, OutputError
from qualify.store import (
    atomic_write,
    atomic_write_bytes,
    dumps_json,
    read_json,
    read_json_object,
    read_tensors,
    write_json,
    write_tensors,
)


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_failed_write_leaves_no_temp_file_and_keeps_the_old_content(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, half_then_fail)
    assert names(tmp_path) == ["out.json"] and target.read_text() == "old"


def test_interrupted_write_leaves_no_temp_file(tmp_path):
    def interrupted(tmp: Path) -> None:
        tmp.write_text("partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "new.bin", interrupted)
    assert names(tmp_path) == []


def test_unserializable_json_writes_nothing(tmp_path):
    with pytest.raises(ValueError):
        write_json(tmp_path / "nan.json", {"x": float("nan")})
    assert names(tmp_path) == []


def test_write_creates_parents_and_replaces(tmp_path):
    target = tmp_path / "a" / "b" / "c.bin"
    atomic_write_bytes(target, b"one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two" and names(target.parent) == ["c.bin"]


def test_written_file_gets_the_umask_mode_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        target = tmp_path / "x.json"
        write_json(target, {})
    finally:
        os.umask(old)
    from qualify.store import _FILE_MODE

    assert stat.S_IMODE(target.stat().st_mode) == _FILE_MODE and _FILE_MODE & 0o044  # group/others can read


def test_json_is_sorted_indented_ascii_with_newline(tmp_path):
    target = tmp_path / "doc.json"
    write_json(target, {"b": 1, "a": [1, 2], "c": {"z": "\u00e9", "y": None}})
    expected = ('{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1,\n  "c": {\n    "y": null,\n    "z": "\\u00e9"\n  }\n}\n')
    assert target.read_text() == expected == dumps_json({"c": {"y": None, "z": "\u00e9"}, "b": 1, "a": [1, 2]})
    assert read_json(target) == {"a": [1, 2], "b": 1, "c": {"y": None, "z": "\u00e9"}}


def test_json_writes_are_byte_reproducible(tmp_path):
    doc = {str(i): list(range(i)) for i in range(20, 0, -1)}
    write_json(tmp_path / "1.json", doc)
    write_json(tmp_path / "2.json", dict(reversed(list(doc.items()))))
    assert (tmp_path / "1.json").read_bytes() == (tmp_path / "2.json").read_bytes()


@pytest.mark.parametrize("content, expected", [
    (None, "missing file"),
    (b"{not json", "malformed JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
])
def test_read_json_errors_are_evidence_errors(tmp_path, content, expected):
    path = tmp_path / "x.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(EvidenceError, match=expected):
        read_json(path)


def test_read_json_of_a_directory(tmp_path):
    with pytest.raises(EvidenceError, match="cannot read"):
        read_json(tmp_path)


def test_safetensors_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(8, 4, generator=gen)
    tensors = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed,  # tied: shares storage with the embedding
        "model.norm.weight": torch.randn(4, generator=gen).to(torch.bfloat16),
        "transposed": torch.randn(3, 5, generator=gen).t(),  # not contiguous
        "tokens": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(1.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
    }
    path = tmp_path / "t" / "x.safetensors"
    write_tensors(path, tensors, metadata={"role": "actor"})
    back = read_tensors(path)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t), name
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        assert handle.metadata() == {"role": "actor"}
    assert names(path.parent) == ["x.safetensors"]


def test_read_tensors_errors(tmp_path):
    with pytest.raises(EvidenceError, match="missing tensor file"):
        read_tensors(tmp_path / "absent.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage" * 3)
    with pytest.raises(EvidenceError, match="not a readable safetensors file"):
        read_tensors(bad)


def test_dumps_json_matches_json_module():
    doc = {"k": [1.5, "s", None, True], "a": {"b": 2}}
    assert json.loads(dumps_json(doc)) == doc and dumps_json(doc).endswith("}\n")


def test_safetensors_files_follow_the_umask_like_a_plain_file(tmp_path):
    """Issue 14 item 5: evidence tensors were written 0600, unreadable to the other users of a cluster."""
    torch = pytest.importorskip("torch")
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"")  # what the umask gives any other file
    target = tmp_path / "t.safetensors"
    write_tensors(target, {"w": torch.zeros(3)})
    assert stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)


def test_umask_is_followed_in_a_fresh_process(tmp_path):
    """Under umask 027 evidence is group-readable and closed to others, JSON and tensors alike."""
    pytest.importorskip("torch")
    code = ("import os, stat, torch; from qualify.store import write_json, write_tensors; "
            f"d = {str(tmp_path)!r}; write_json(d + '/a.json', {{}}); write_tensors(d + '/b.safetensors', "
            "{'w': torch.zeros(2)}); print(*(oct(stat.S_IMODE(os.stat(d + f).st_mode)) for f in ('/a.json', '/b.safetensors')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          preexec_fn=lambda: os.umask(0o027))
    assert proc.stdout.split() == ["0o640", "0o640"]


def test_writing_onto_a_directory_is_an_output_error(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(OutputError, match=r"cannot write .*/d: it is a directory"):
        write_json(tmp_path / "d", {})
    assert names(tmp_path) == ["d"] and names(tmp_path / "d") == []


@pytest.mark.parametrize("what", ["json", "tensors"])
def test_a_full_disk_is_an_output_error_and_leaves_nothing(tmp_path, what):
    """RLIMIT_FSIZE makes the kernel refuse the write (EFBIG) as a full disk would (ENOSPC)."""
    if what == "tensors":
        pytest.importorskip("torch")
    write = ("write_json(d + '/out', {'x': list(range(100000))})" if what == "json" else
             "import torch; write_tensors(d + '/out', {'w': torch.zeros(100000)})")
    code = (f"from qualify.store import write_json, write_tensors; from qualify.errors import OutputError\n"
            f"d = {str(tmp_path)!r}\ntry:\n    {write}\nexcept OutputError as e:\n    print('OutputError:', e)\n")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, preexec_fn=limit)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"OutputError: cannot write {tmp_path}/out: ") and proc.stdout.count("\n") == 1
    assert names(tmp_path) == []


@pytest.mark.parametrize("content, expected", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"n": ' + b"9" * 5000 + b"}", "malformed JSON"),
])
def test_read_json_of_hostile_json(tmp_path, content, expected):
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(EvidenceError, match=expected) as info:
        read_json(path)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


@pytest.mark.parametrize("content, expected", [
    ("[1, 2]", "x.json: not a reference summary (a JSON list, not an object)"),
    ('{"controls": []}', "x.json: not a reference summary: no 'matrix' key (nor 'rollout_digest')"),
    ('{"controls": [], "rollout_digest": "d"}', "x.json: not a reference summary: no 'matrix' key"),
])
def test_read_json_object_names_the_missing_key(tmp_path, content, expected):
    path = tmp_path / "x.json"
    path.write_text(content)
    with pytest.raises(EvidenceError, match=re.escape(expected)):
        read_json_object(path, "reference summary", ("matrix", "controls", "rollout_digest"))
    path.write_text('{"matrix": {}, "controls": [], "rollout_digest": "d", "more": 1}')
    assert read_json_object(path, "reference summary", ("matrix", "controls", "rollout_digest"))["more"] == 1


def test_empty_tensor_dict_round_trips(tmp_path):
    """An engine that skipped its step has no optimizer state: its empty file must read back as empty."""
    from qualify.store import read_tensors, write_tensors

    write_tensors(tmp_path / "m.safetensors", {})
    assert read_tensors(tmp_path / "m.safetensors") == {}


def test_a_killed_writers_temp_file_is_removed_by_the_next_write_in_its_directory(tmp_path):
    from qualify.store import write_json
    from tests.integration._support import killed_writer

    killed_writer(tmp_path / "acceptance.json")
    left = [n for n in names(tmp_path) if n.endswith(".tmp")]
    assert len(left) == 1 and left[0].startswith(".acceptance.json.")  # what a killed run leaves
    live = killed_writer(tmp_path / "other.json", kill=False)
    try:
        write_json(tmp_path / "acceptance.json", {"a": 1})
        remaining = [n for n in names(tmp_path) if n.endswith(".tmp")]
        assert len(remaining) == 1 and remaining[0].startswith(".other.json.")  # a live writer's is kept
        assert json.loads((tmp_path / "acceptance.json").read_text()) == {"a": 1}
    finally:
        live.kill()
        live.wait()


def test_a_killed_report_leaves_nothing_once_the_report_runs_again(tmp_path):
    """`qualify report --out` killed while it wrote: the next report removes the temp file and writes the report."""
    from typer.testing import CliRunner

    from qualify.cli.app import app
    from qualify.layout import RunLayout
    from tests.integration._support import killed_writer

    run = tmp_path / "run"
    RunLayout(run).reference.mkdir(parents=True)
    RunLayout(run).reference_summary.write_text(json.dumps({
        "matrix": {"name": "tiny"}, "rollout_digest": "sha256:roll", "tp_agreement": {}, "rollout_mismatch": {},
        "controls": ["r0"]}))
    out = tmp_path / "out" / "report.json"
    out.parent.mkdir()
    killed_writer(out)
    assert any(n.endswith(".tmp") for n in names(out.parent))
    CliRunner().invoke(app, ["report", str(run), "--format", "json", "--out", str(out)])
    assert names(out.parent) == ["report.json"] and json.loads(out.read_text())["matrix"] == "tiny"
