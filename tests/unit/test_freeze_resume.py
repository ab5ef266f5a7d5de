"""An interrupted freeze resumes where it stopped (qualify.freeze.FreezeWork): the bound files it finished are kept
under acceptance.work/ with a key of everything they are made from, taken by the next freeze of the same evidence and
code, and discarded when the evidence changed; the acceptance is the one a straight freeze writes, byte for byte."""

from __future__ import annotations

import shutil

import pytest

from qualify import freeze as freeze_module
from qualify.freeze import freeze
from qualify.stages import complete_stage, stage_info
from tests.unit._runs import synthetic_matrix, synthetic_reference


class Interrupted(Exception):
    pass


def interrupt_after(monkeypatch, n):
    """family_bounds raises on its (n+1)-th call; returns the list of the (role, family) it was called for."""
    real, calls = freeze_module.family_bounds, []

    def counting(layout, role, family, *args, **kwargs):
        if len(calls) == n:
            raise Interrupted(f"stopped before {role} {family}")
        calls.append((role, family))
        return real(layout, role, family, *args, **kwargs)
    monkeypatch.setattr(freeze_module, "family_bounds", counting)
    return calls


def test_an_interrupted_freeze_resumes_and_writes_what_a_straight_one_writes(tmp_path, monkeypatch):
    straight = synthetic_reference(tmp_path / "straight", synthetic_matrix(tmp_path))
    freeze(straight.root)
    layout = synthetic_reference(tmp_path / "run", synthetic_matrix(tmp_path))
    first = interrupt_after(monkeypatch, 4)
    with pytest.raises(Interrupted):
        freeze(layout.root)
    assert not layout.acceptance.exists() and len(list(layout.freeze_work.glob("*-*.json"))) == 4
    monkeypatch.undo()
    second = interrupt_after(monkeypatch, 100)
    freeze(layout.root)
    assert len(second) == 6 - 4 and not set(second) & set(first)  # only what the first did not finish
    assert not layout.freeze_work.exists()
    for path in sorted(straight.bounds.glob("*.json")):
        assert (layout.bounds / path.name).read_bytes() == path.read_bytes(), path.name
    theirs, mine = (p.acceptance.read_text().replace(str(p.root), "") for p in (straight, layout))
    assert mine == theirs


def test_kept_bounds_of_other_evidence_are_discarded(tmp_path, monkeypatch):
    layout = synthetic_reference(tmp_path / "run", synthetic_matrix(tmp_path))
    interrupt_after(monkeypatch, 3)
    with pytest.raises(Interrupted):
        freeze(layout.root)
    monkeypatch.undo()
    # the evidence changes under the kept files (a control's run sealed again with other contents)
    victim = layout.scores("fp32", "r1", "actor")
    meta = victim / "meta.json"
    meta.write_text(meta.read_text().rstrip() + " ")
    complete_stage(victim, stage_info(victim))
    again = interrupt_after(monkeypatch, 100)
    freeze(layout.root)
    assert len(again) == 6  # nothing kept was taken


def test_a_kept_file_without_its_key_is_not_taken(tmp_path, monkeypatch):
    layout = synthetic_reference(tmp_path / "run", synthetic_matrix(tmp_path))
    interrupt_after(monkeypatch, 2)
    with pytest.raises(Interrupted):
        freeze(layout.root)
    monkeypatch.undo()
    (layout.freeze_work / "key.json").unlink()
    again = interrupt_after(monkeypatch, 100)
    freeze(layout.root)
    assert len(again) == 6
    shutil.rmtree(layout.acceptance_dir)
