"""The candidate stage judges a case as soon as it is sealed, while other launch groups still run
(qualify.candidate.launches.Scheduler.run), and the judge's GPU copies leave the launches their share of the device
(qualify.resident.Resident.reserving)."""

from __future__ import annotations

import threading

import pytest
import torch

from qualify.candidate import launches
from qualify.layout import RunLayout
from qualify.matrix import Case
from qualify.resident import Resident
from qualify.stagelog import StageLog
from qualify.stages import MARKER


def _case(engine: str) -> Case:
    return Case(engine=engine, precision="fp32", tp=1, role="actor")


def test_a_sealed_case_is_judged_while_another_launch_still_runs(tmp_path, monkeypatch):
    """Two launch groups, one launch at a time: the second group's launch cannot end before the first group's case
    has been judged (it waits for it), so the stage only finishes when judging runs beside the launches."""
    layout = RunLayout(tmp_path)
    first, second = _case("torch-tp"), _case("megatron")
    judged_first, launched = threading.Event(), []

    def launch_group(pending, need=None):
        launched.append([c.name for c in pending])
        if pending == [first]:  # seal the first case, as a worker does at its end
            layout.case(first.name).mkdir(parents=True)
            (layout.case(first.name) / MARKER).write_text("{}")
            return {}
        return {} if judged_first.wait(timeout=120) else {second.name: "never judged while this launch ran"}

    def judge_ready() -> bool:
        if not judged_first.is_set() and launches.marked_complete(layout.case(first.name)):
            judged_first.set()
            return True
        return False

    scheduler = launches.Scheduler(layout, [first, second], {}, "cpu", StageLog("test"))
    monkeypatch.setattr(scheduler, "launch_group", launch_group)  # the launches' order and sealing, not ranks
    monkeypatch.setattr(scheduler, "judge_ready", judge_ready)
    errors = scheduler.run([[first], [second]], 1, early=True)
    assert launched == [[first.name], [second.name]]
    assert errors == {} and judged_first.is_set()


def test_marked_complete_reads_the_marker_only(tmp_path):
    assert not launches.marked_complete(tmp_path)
    (tmp_path / MARKER).write_text("{}")
    assert launches.marked_complete(tmp_path)


def test_reserving_leaves_what_the_launches_plan_to_them_then_gives_it_back():
    resident = Resident(torch.device("cpu"))
    planned = [int(0.25 * resident.total())]
    with resident.reserving(lambda: planned[0]):
        assert resident.reserved() == planned[0]
        inside = resident.room()
        planned[0] = 0  # the launch ended: asked again at every room()
        after_launch = resident.room()
    outside = resident.room()
    assert resident.reserved() == 0
    assert outside - inside == pytest.approx(int(0.25 * resident.total()), rel=0.05)
    assert after_launch - inside == pytest.approx(int(0.25 * resident.total()), rel=0.05)


def test_nothing_is_reserved_where_nothing_is_held():
    resident = Resident(None)
    with resident.reserving(lambda: 1 << 40):
        assert resident.reserved() == 0


def test_after_drop_nothing_whole_is_copied():
    """After an out-of-memory (Resident.drop) the stage judges tensor by tensor: a run is not copied whole, an r0 or
    start is not kept."""
    resident = Resident(torch.device("cpu"))
    initial = {"w": torch.ones(3)}
    assert resident.start("actor", initial) is not initial  # kept (as fp64) while there is room
    resident.drop()
    assert resident.kept == {} and resident.kept_bytes == 0
    assert resident.start("actor", initial) is initial
