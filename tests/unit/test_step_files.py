"""StepFiles and StepStarts (qualify.compare): a role directory's steps read one at a time give what load_steps and
params_before_steps give, while holding at most two steps."""

from __future__ import annotations

import pytest
import torch

from qualify import compare
from qualify.compare import StepFiles, load_steps, params_before_steps
from tests.unit._runs import eager_starts, params, role_steps, write_steps


def test_step_files_are_the_loaded_steps_and_their_starts_read_step_by_step(tmp_path, monkeypatch):
    write_steps(tmp_path, role_steps("actor", 0.0, 3))
    eager, lazy = load_steps(tmp_path), StepFiles(tmp_path)
    assert len(lazy) == len(eager) == 3
    reads = []
    real = compare.load_run
    monkeypatch.setattr(compare, "load_run", lambda d, k=0: reads.append(k) or real(d, k))
    starts_eager, starts_lazy = eager_starts(eager, params()), params_before_steps(lazy, params())
    for k in range(3):
        step = lazy[k]
        for group in ("outputs", "grads", "updates", "moments"):
            for name, t in getattr(eager[k], group).items():
                assert torch.equal(getattr(step, group)[name], t), (k, group, name)
        for name, t in starts_eager[k].items():
            assert torch.equal(starts_lazy[k][name], t) and t.dtype == torch.float64, (k, name)
        assert len(lazy._kept) <= 2
    assert reads == [0, 1, 2]  # each step read once when walked in order, its start advanced from the one before
    assert torch.equal(starts_lazy[0]["w"], starts_eager[0]["w"])  # going back starts again from the initial ones
    assert [s.outputs["loss"] for s in lazy[1:]] == [s.outputs["loss"] for s in eager[1:]]
    with pytest.raises(IndexError):
        lazy[3]
