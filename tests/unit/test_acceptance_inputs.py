"""Inputs that look like an acceptance or a reference and are not: one-line errors, never a KeyError."""

from __future__ import annotations

import pytest

from qualify.acceptance import Acceptance
from qualify.errors import EvidenceError, FrozenError, ManifestError
from qualify.freeze import freeze
from qualify.layout import RunLayout
from qualify.manifest import create_manifest
from qualify.store import write_json


def test_plain_manifest_is_not_an_acceptance(tmp_path):
    layout = RunLayout(tmp_path / "run")
    layout.reference.mkdir(parents=True)
    (layout.reference / "x.txt").write_text("x")
    plain = tmp_path / "plain.json"
    create_manifest(layout.reference, plain, progress=False)
    with pytest.raises(ManifestError, match="not an acceptance manifest"):
        Acceptance.load(plain, layout.reference)


@pytest.mark.parametrize("summary,match", [({}, "no 'controls' key"), ([1, 2], "not an object"),
                                           ({"controls": ["r0"]}, "no 'matrix_digest' key")])
def test_freeze_refuses_a_summary_without_what_it_needs(tmp_path, summary, match):
    layout = RunLayout(tmp_path / "run")
    write_json(layout.reference_summary, summary)
    with pytest.raises(EvidenceError, match=match):
        freeze(layout.root)


def test_freeze_refuses_a_reference_without_its_sealed_matrix_snapshot(tmp_path):
    layout = RunLayout(tmp_path / "run")
    write_json(layout.reference_summary, {"controls": ["r0"], "matrix_digest": "sha256:" + "0" * 64,
                                          "rollout_digest": "x", "targets_digest": "y", "matrix": {"freeze": {"k": 1000}}})
    with pytest.raises(EvidenceError, match="matrix snapshot"):
        freeze(layout.root)


def test_freeze_without_a_reference_says_so(tmp_path):
    with pytest.raises(FrozenError, match="no complete reference"):
        freeze(tmp_path)
