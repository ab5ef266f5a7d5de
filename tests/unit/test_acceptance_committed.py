"""Every committed acceptance (manifests/*/acceptance.json) is sound: schema, bound digests, rule."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qualify.acceptance import check_acceptance
from qualify.errors import ManifestError

REPO = Path(__file__).resolve().parents[2]
COMMITTED = sorted((REPO / "manifests").glob("*/acceptance.json"))


def test_there_is_a_committed_acceptance():
    assert any(p.parent.name == "tiny-qwen3" for p in COMMITTED)


@pytest.mark.parametrize("path", COMMITTED, ids=[p.parent.name for p in COMMITTED])
def test_committed_acceptance_is_sound(path):
    assert check_acceptance(path) == []


def _copy(tmp_path: Path) -> Path:
    src = REPO / "manifests" / "tiny-qwen3"
    dst = tmp_path / "acc"
    shutil.copytree(src, dst)
    return dst / "acceptance.json"


def test_edited_bound_file_is_caught(tmp_path):
    acc = _copy(tmp_path)
    bound = acc.parent / "bounds" / "actor-fp32-repeat.json"
    bound.write_text(bound.read_text().replace('"k": 4.0', '"k": 4.5'))
    assert any("does not match" in p for p in check_acceptance(acc))


def test_bound_that_breaks_the_rule_is_caught(tmp_path):
    from qualify.acceptance import check_bounds

    doc = json.loads((REPO / "manifests/tiny-qwen3/bounds/critic-bf16-repeat.json").read_text())
    rule = json.loads((REPO / "manifests/tiny-qwen3/acceptance.json").read_text())["rule"]
    key = min(doc["bounds"])
    metric = min(doc["bounds"][key])
    doc["bounds"][key][metric]["bound"] *= 2
    assert any(key in p for p in check_bounds(doc, rule, "x.json"))


def test_hand_edited_acceptance_is_refused(tmp_path):
    acc = _copy(tmp_path)
    acc.write_text(acc.read_text().replace('"k": 4.0', '"k": 8.0', 1))
    with pytest.raises(ManifestError, match="digest"):
        check_acceptance(acc)
