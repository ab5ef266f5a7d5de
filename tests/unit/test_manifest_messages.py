"""load_manifest's refusals name the manifest file they come from."""

from __future__ import annotations

import json

import pytest

from qualify.errors import ManifestError
from qualify.manifest import create_manifest, load_manifest


def test_a_hand_edited_manifest_is_refused_naming_its_file(tmp_path):
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "a.bin").write_bytes(b"a")
    path = tmp_path / "m.json"
    create_manifest(tmp_path / "ev", path, progress=False)
    assert load_manifest(path)["files"][0]["path"] == "a.bin"
    doc = json.loads(path.read_text())
    doc["files"][0]["bytes"] = 2
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError) as caught:
        load_manifest(path)
    assert str(caught.value) == f"{path}: manifest digest does not match its content (edited by hand?)"
    doc["files"][0]["sha256"] = "X" * 64
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=f"^{path}: files\\[0\\] \\(a.bin\\): sha256 must be 64 lowercase hex"):
        load_manifest(path)
