"""The reference refuses to start a run the disk cannot hold (qualify.reference.summary.require_space): at Qwen3
shapes a run writes gigabytes, and one that fills the disk half-way is lost."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from qualify.errors import QualifyError
from qualify.layout import RunLayout
from qualify.reference import summary
from qualify.reference.summary import expected_run_bytes, require_space
from qualify.stages import complete_stage

Usage = namedtuple("Usage", "total used free")


def test_the_first_run_is_estimated_from_the_model_and_later_ones_from_a_run_kept_in_full(tmp_path):
    layout = RunLayout(tmp_path / "run")
    model = layout.model("actor")
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"m" * 1000)
    need, basis = expected_run_bytes(layout, model, "actor", 3)
    assert need == 4 * 3 * 1000 and "4 x 3 step(s)" in basis
    done = layout.scores("fp32", "r0", "actor")
    (done / "step0").mkdir(parents=True)
    (done / "step0" / "grads.safetensors").write_bytes(b"g" * 5000)
    assert expected_run_bytes(layout, model, "actor", 3)[0] == 12000  # not sealed yet: not a measure
    complete_stage(done)
    need, basis = expected_run_bytes(layout, model, "actor", 3)
    assert need == sum(p.stat().st_size for p in done.rglob("*") if p.is_file()) and "scores/fp32-r0/actor" in basis
    assert expected_run_bytes(layout, model, "critic", 1)[0] == 4000  # no run of this role yet: the model given is the measure


def test_a_run_the_disk_cannot_hold_is_refused_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(summary.shutil, "disk_usage", lambda p: Usage(10**12, 10**12 - 5 * 10**8, 5 * 10**8))
    target = tmp_path / "run" / "reference" / "scores" / "fp32-r0" / "actor"  # not made yet: its nearest ancestor
    with pytest.raises(QualifyError, match=r"scoring fp32-r0 actor needs about 2\.00 GB \(a basis\), but only 0\.50 "
                                           r"GB are free under .*: free space.*layer_activations: false"):
        require_space(target, 2 * 10**9, "a basis", "scoring fp32-r0 actor")
    require_space(target, 4 * 10**8, "a basis", "scoring fp32-r0 actor")  # fits: nothing said
    assert not target.exists()


def test_the_real_disk_is_asked(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(QualifyError, match="are free under"):
        require_space(tmp_path / "x", free + 10**15, "more than any disk", "scoring")
