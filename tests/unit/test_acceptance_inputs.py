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


def test_bounds_checked_against_no_rule_or_an_unknown_kind_are_problems_not_key_errors():
    from qualify.bounds.check import check_bounds
    from qualify.bounds.rule import BOUNDS_SCHEMA

    entry = {"kind": "grad", "control_error": 1e-7, "floor": 1e-6, "quantum": 0.0, "bound": 1.4e-6}
    doc = {"schema": BOUNDS_SCHEMA, "k": 4.0, "floors": {"grad": 1e-6}, "bounds": {"step0/grads/w": {"max_abs": entry}}}
    assert check_bounds(doc, {"k": 4.0, "floors": {"grad": 1e-6}}, "b.json") == []
    assert any("has no rule" in p for p in check_bounds(doc, {}, "b.json"))
    odd = {**doc, "bounds": {"step0/grads/w": {"max_abs": {**entry, "kind": "nonsense"}}}}
    assert any("has no floor in the rule" in p for p in check_bounds(odd, {"k": 4.0, "floors": {"grad": 1e-6}}, "b"))
