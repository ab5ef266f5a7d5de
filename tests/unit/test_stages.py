"""Resumable stage directories: complete ones are kept and never overwritten, partial ones redone."""

from __future__ import annotations

import pytest

from qualify.errors import EvidenceError, FrozenError
from qualify.stages import (
    complete_stage,
    fingerprint,
    prepare_stage,
    require_complete,
    reuse_complete,
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


def test_reuse_refuses_complete_output_made_with_other_settings(tmp_path):
    out = tmp_path / "s"
    assert reuse_complete(out, fingerprint({"a": 1}), "s") is False
    prepare_stage(out)
    complete_stage(out, {"settings": fingerprint({"a": 1})})
    assert reuse_complete(out, fingerprint({"a": 1}), "s") is True
    with pytest.raises(FrozenError, match="other settings"):
        reuse_complete(out, fingerprint({"a": 2}), "s")
