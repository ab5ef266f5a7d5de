"""qualify.stages: what mutation testing found unpinned (issue 20).

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
