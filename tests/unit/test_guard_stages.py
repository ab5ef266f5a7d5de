"""qualify.stages: what mutation testing found unpinned.

A marker without an 'info' map (one written before infos were recorded, or by hand) still verifies;
its info is the empty map, so a resume asking for settings is refused with FrozenError by name,
never with an AttributeError on None.
"""

from __future__ import annotations

import hashlib

import pytest

from qualify.errors import FrozenError
from qualify.stages import fingerprint, reuse_complete, stage_info, stage_is_complete
from qualify.store import write_json


def sealed_without_info(tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    (out / "a.bin").write_bytes(b"abc")
    write_json(out / "_complete.json", {"files": {"a.bin": [3, hashlib.sha256(b"abc").hexdigest()]}})
    return out


def test_a_marker_without_info_has_an_empty_info(tmp_path):
    out = sealed_without_info(tmp_path)
    assert stage_is_complete(out)
    assert stage_info(out) == {}


def test_reuse_of_a_marker_without_info_is_refused_by_name(tmp_path):
    out = sealed_without_info(tmp_path)
    with pytest.raises(FrozenError) as caught:
        reuse_complete(out, fingerprint({"a": 1}), "thing")
    assert str(caught.value) == (f"thing at {out} was made with other settings than the matrix now asks for; "
                                 "it is never overwritten: use another --out directory")


# --- seal / open_sealed / write_tensor_stage (the one sealing API) ------------------------------------------------

def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_seal_records_every_file_and_the_main_files_digest_without_touching_the_callers_info(tmp_path):
    from qualify.stages import seal
    from qualify.store import read_json

    out = tmp_path / "s"
    out.mkdir()
    (out / "main.bin").write_bytes(b"main")
    (out / "meta.json").write_text("{}")
    info = {"settings": "sha256:s"}
    assert seal(out, info, main="main.bin") == "sha256:" + sha(b"main")
    assert info == {"settings": "sha256:s"}  # the caller's dict is copied, not written into
    assert read_json(out / "_complete.json") == {
        "files": {"main.bin": [4, sha(b"main")], "meta.json": [2, sha(b"{}")]},
        "info": {"settings": "sha256:s", "digest": "sha256:" + sha(b"main")}}
    assert stage_is_complete(out)


def test_seal_without_main_returns_none_and_records_info_as_given(tmp_path):
    from qualify.stages import seal
    from qualify.store import read_json

    out = tmp_path / "s"
    out.mkdir()
    (out / "a.bin").write_bytes(b"abc")
    assert seal(out, {"digest": "sha256:given"}) is None
    assert read_json(out / "_complete.json") == {"files": {"a.bin": [3, sha(b"abc")]},
                                                 "info": {"digest": "sha256:given"}}
    assert seal(out) is None  # resealing re-lists the files: the marker itself is never one of them
    assert read_json(out / "_complete.json") == {"files": {"a.bin": [3, sha(b"abc")]}, "info": {}}


def test_seal_refuses_a_main_file_it_does_not_hold(tmp_path):
    from qualify.errors import EvidenceError
    from qualify.stages import seal

    out = tmp_path / "s"
    out.mkdir()
    (out / "a.bin").write_bytes(b"abc")
    with pytest.raises(EvidenceError) as caught:
        seal(out, main="b.bin")
    assert str(caught.value) == f"cannot seal {out}: it holds no b.bin"
    assert not (out / "_complete.json").exists()


def test_open_sealed_verifies_and_checks_the_expected_digest(tmp_path):
    from qualify.errors import EvidenceError
    from qualify.stages import Sealed, open_sealed, seal

    out = tmp_path / "s"
    with pytest.raises(EvidenceError) as caught:
        open_sealed(out, "rollout")
    assert str(caught.value) == f"rollout at {out} is missing, partial or modified; rerun the stage that makes it"
    out.mkdir()
    (out / "main.bin").write_bytes(b"main")
    (out / "other.bin").write_bytes(b"other")
    main = "sha256:" + sha(b"main")
    seal(out, {"k": 1}, main="main.bin")
    sealed = open_sealed(out, "rollout", main)
    assert sealed == Sealed(out, {"main.bin": [4, sha(b"main")], "other.bin": [5, sha(b"other")]},
                            {"k": 1, "digest": main})
    assert open_sealed(out, "rollout") == sealed  # no expected digest: verified only
    assert open_sealed(out, "rollout", "sha256:" + sha(b"other"), main="other.bin").path == out
    assert sealed.digest("other.bin") == "sha256:" + sha(b"other")
    with pytest.raises(EvidenceError) as caught:
        sealed.digest("absent.bin")
    assert str(caught.value) == f"{out} holds no absent.bin"
    with pytest.raises(EvidenceError) as caught:
        open_sealed(out, "rollout", "sha256:" + sha(b"x"))
    assert str(caught.value) == (f"rollout at {out} has digest {main}, expected sha256:{sha(b'x')}: refusing to run "
                                 "on a different rollout")
    with pytest.raises(EvidenceError) as caught:  # main names the file whose digest is checked, not the info's
        open_sealed(out, "rollout", main, main="other.bin")
    assert f"has digest sha256:{sha(b'other')}, expected {main}" in str(caught.value)
    (out / "other.bin").write_bytes(b"0ther")
    with pytest.raises(EvidenceError, match="missing, partial or modified"):
        open_sealed(out, "rollout", main)


def test_a_sealed_stage_without_a_recorded_digest_is_refused_when_one_is_expected(tmp_path):
    from qualify.errors import EvidenceError
    from qualify.stages import open_sealed, seal

    out = tmp_path / "s"
    out.mkdir()
    (out / "a.bin").write_bytes(b"abc")
    seal(out)
    with pytest.raises(EvidenceError) as caught:
        open_sealed(out, "targets", "sha256:" + sha(b"abc"))
    assert str(caught.value).startswith(f"targets at {out} has digest None, expected sha256:")


@pytest.mark.parametrize("marker", ['{"files": ["a.bin"], "info": {}}', '{"files": "a.bin"}', '[]', '"files"',
                                    '{"files": {"a.bin": [3, "x"]}}'])
def test_check_sealed_is_none_for_a_marker_that_does_not_verify(tmp_path, marker):
    from qualify.stages import check_sealed

    out = tmp_path / "s"
    out.mkdir()
    (out / "a.bin").write_bytes(b"abc")
    (out / "_complete.json").write_text(marker)
    assert check_sealed(out) is None
    assert not stage_is_complete(out)


def test_check_sealed_gives_the_recorded_files_and_info(tmp_path):
    from qualify.stages import Sealed, check_sealed

    out = sealed_without_info(tmp_path)
    assert check_sealed(out) == Sealed(out, {"a.bin": [3, sha(b"abc")]}, {})
    assert check_sealed(tmp_path / "absent") is None


def test_write_tensor_stage_writes_digests_meta_and_seal(tmp_path):
    import torch

    from qualify.errors import EvidenceError
    from qualify.stages import open_sealed, write_tensor_stage
    from qualify.store import read_json, read_tensors

    out = tmp_path / "a" / "stage"
    out.mkdir(parents=True)
    (out / "stale.bin").write_bytes(b"partial")  # an unsealed earlier attempt is removed first
    tensors = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    digest = write_tensor_stage(out, "t.safetensors", tensors, "meta.json", {"case": "c"}, {"settings": "s"})
    data = (out / "t.safetensors").read_bytes()
    assert digest == "sha256:" + sha(data)
    assert sorted(p.name for p in out.iterdir()) == ["_complete.json", "meta.json", "t.safetensors"]
    assert read_json(out / "meta.json") == {"case": "c", "digest": digest}
    assert torch.equal(read_tensors(out / "t.safetensors")["x"], tensors["x"])
    meta = (out / "meta.json").read_bytes()
    assert read_json(out / "_complete.json") == {
        "files": {"meta.json": [len(meta), sha(meta)], "t.safetensors": [len(data), sha(data)]},
        "info": {"settings": "s", "digest": digest}}
    assert open_sealed(out, "targets", digest).info["digest"] == digest
    with pytest.raises(EvidenceError, match="refusing to overwrite a complete stage output"):
        write_tensor_stage(out, "t.safetensors", tensors, "meta.json", {})


def test_stage_verification_hashes_the_scanned_files_silently_with_their_scanned_sizes(tmp_path, monkeypatch):
    from qualify import stages

    calls = []
    real = stages.hash_files

    def recording(root, paths, jobs=None, progress=True, *, sizes=None):
        calls.append((list(paths), progress, sizes))
        return real(root, paths, jobs, False, sizes=sizes)

    out = sealed_without_info(tmp_path)
    (out / "sub").mkdir()
    (out / "sub" / "b.bin").write_bytes(b"bb")
    monkeypatch.setattr(stages, "hash_files", recording)
    assert not stage_is_complete(out)  # sub/b.bin is not in the marker
    # no bar (a stage check is part of a larger step), and the sizes the scan found (no second stat per file)
    assert calls == [(["a.bin", "sub/b.bin"], False, {"a.bin": 3, "sub/b.bin": 2})]
