"""Resumable stage directories: complete ones are kept and never overwritten, partial ones redone."""

from __future__ import annotations

import pytest

from qualify.errors import EvidenceError, FrozenError
from qualify.stages import (
    check_sealed,
    check_sealed_all,
    complete_stage,
    fingerprint,
    prepare_stage,
    require_all_complete,
    require_complete,
    reuse_complete,
    stage_info,
    stage_is_complete,
)


def test_complete_stage_verifies_and_is_not_overwritten(tmp_path):
    out = tmp_path / "s"
    prepare_stage(out)
    (out / "a.bin").write_bytes(b"abc")
    complete_stage(out, {"settings": "x"})
    assert stage_is_complete(out)
    require_complete(out, "s")
    with pytest.raises(EvidenceError, match="refusing to overwrite"):
        prepare_stage(out)


@pytest.mark.parametrize("tamper", ["modify", "add", "delete", "marker"])
def test_tampered_or_partial_stage_is_not_complete_and_is_redone(tmp_path, tamper):
    out = tmp_path / "s"
    prepare_stage(out)
    (out / "a.bin").write_bytes(b"abc")
    complete_stage(out)
    {"modify": lambda: (out / "a.bin").write_bytes(b"abd"), "add": lambda: (out / "b.bin").write_bytes(b"x"),
     "delete": lambda: (out / "a.bin").unlink(), "marker": lambda: (out / "_complete.json").write_text("{")}[tamper]()
    assert not stage_is_complete(out)
    with pytest.raises(EvidenceError):
        require_complete(out, "s")
    prepare_stage(out)  # a partial output is removed, never trusted
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("tamper", ["modify", "add", "delete", "marker"])
def test_sealed_directories_verified_together_agree_with_one_at_a_time(tmp_path, tamper):
    dirs = {}
    for i, where in enumerate(["a/x", "a/y/z", "b", "c"]):  # directories at different depths, one large file
        out = dirs[where] = tmp_path / where
        prepare_stage(out)
        (out / "f.bin").write_bytes(bytes([i]) * (300_000 if where == "b" else 10 + i))
        (out / "sub").mkdir()
        (out / "sub" / "g.txt").write_text(where)
        complete_stage(out, {"digest": where})
    unsealed = tmp_path / "d"
    unsealed.mkdir()
    bad = dirs["a/y/z"]
    {"modify": lambda: (bad / "f.bin").write_bytes(b"changed"), "add": lambda: (bad / "h.bin").write_bytes(b"x"),
     "delete": lambda: (bad / "sub" / "g.txt").unlink(), "marker": lambda: (bad / "_complete.json").write_text("{")}[tamper]()
    together = check_sealed_all([*dirs.values(), unsealed])
    assert together == {p: check_sealed(p) for p in [*dirs.values(), unsealed]}
    assert [p for p, s in together.items() if s is None] == [bad, unsealed]  # the negative controls
    assert together[dirs["b"]].info == {"digest": "b"}
    assert set(require_all_complete([(dirs[w], w) for w in ("a/x", "b", "c")])) == {dirs[w] for w in ("a/x", "b", "c")}
    with pytest.raises(EvidenceError, match="a/y/z at .* is missing, partial or modified"):
        require_all_complete([(dirs["a/x"], "a/x"), (bad, "a/y/z")])
    assert check_sealed_all([]) == {}


def test_reuse_refuses_complete_output_made_with_other_settings(tmp_path):
    out = tmp_path / "s"
    assert reuse_complete(out, fingerprint({"a": 1}), "s") is False
    prepare_stage(out)
    complete_stage(out, {"settings": fingerprint({"a": 1})})
    assert reuse_complete(out, fingerprint({"a": 1}), "s") is True
    with pytest.raises(FrozenError, match="other settings"):
        reuse_complete(out, fingerprint({"a": 2}), "s")


def test_marker_records_every_file_but_itself_with_size_and_sha256(tmp_path):
    import hashlib

    from qualify.store import read_json

    out = tmp_path / "a" / "b" / "s"  # parents are made
    prepare_stage(out)
    (out / "sub").mkdir()
    (out / "sub" / "x.bin").write_bytes(b"xyz")
    (out / "y.json").write_text("{}")
    complete_stage(out)
    marker = read_json(out / "_complete.json")
    assert marker == {"files": {"sub/x.bin": [3, hashlib.sha256(b"xyz").hexdigest()],
                                "y.json": [2, hashlib.sha256(b"{}").hexdigest()]}, "info": {}}
    assert stage_info(out) == {}


@pytest.mark.parametrize("marker", ['{"info": {}}', '["files"]', '{"files": ["a.bin"]}', "null"])
def test_a_marker_without_a_files_map_is_not_complete(tmp_path, marker):
    out = tmp_path / "s"
    prepare_stage(out)
    (out / "a.bin").write_bytes(b"abc")
    (out / "_complete.json").write_text(marker)
    assert not stage_is_complete(out)
    with pytest.raises(EvidenceError, match=f"thing at {out} is missing, partial or modified; rerun the stage"):
        require_complete(out, "thing")


def test_stage_info_and_fingerprint(tmp_path):
    import hashlib

    from qualify.store import dumps_json

    out = tmp_path / "s"
    prepare_stage(out)
    complete_stage(out, {"digest": "sha256:x", "settings": fingerprint({"b": 1, "a": [1, 2]})})
    assert stage_info(out) == {"digest": "sha256:x", "settings": fingerprint({"a": [1, 2], "b": 1})}
    assert fingerprint({"a": 1}) == "sha256:" + hashlib.sha256(dumps_json({"a": 1}).encode("ascii")).hexdigest()
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


def test_reuse_of_a_complete_output_without_recorded_settings_is_refused(tmp_path):
    out = tmp_path / "s"
    prepare_stage(out)
    complete_stage(out, {"digest": "sha256:x"})
    with pytest.raises(FrozenError) as caught:
        reuse_complete(out, fingerprint({"a": 1}), "thing")
    assert str(caught.value) == (f"thing at {out} was made with other settings than the matrix now asks for; "
                                 "it is never overwritten: use another --out directory")


def test_a_symlinked_stage_directory_is_refused_not_followed(tmp_path):
    """A stage directory that is a symlink (to another run's sealed case, say) is refused wherever a seal is checked,
    as a symlinked file inside it is: never believed complete, never removed through the link."""
    from qualify.errors import ManifestError
    from qualify.stages import check_sealed, check_sealed_all, prepare_stage, stage_is_complete

    other = tmp_path / "other-run" / "case"
    other.mkdir(parents=True)
    (other / "outputs.json").write_text("{}")
    complete_stage(other, {"case": "x"})
    link = tmp_path / "run" / "case"
    link.parent.mkdir()
    link.symlink_to(other, target_is_directory=True)
    for check in (check_sealed, stage_is_complete, lambda p: check_sealed_all([other, p]), prepare_stage):
        with pytest.raises(ManifestError, match=f"refusing symlinked directory in evidence: {link}"):
            check(link)
    assert stage_is_complete(other) and (other / "outputs.json").is_file()  # the link's target is untouched
