"""freeze warns about a family whose controls measured nothing (qualify.bounds.control_error.silent_controls): every
control reproduced r0 bit for bit, as a plain repeat does on a deterministic GPU, so the bounds are floors alone. The
committed acceptance of the embedded default (perturbed controls) draws no warning; the same files with every output
and gradient control error set to zero do, and one nonzero control error anywhere silences it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from qualify.bounds.control_error import silent_controls

BOUNDS = Path(__file__).resolve().parents[3] / "manifests" / "tiny-qwen3" / "acceptance" / "bounds"


@pytest.fixture(params=sorted(p.name for p in BOUNDS.glob("*.json")))
def committed(request):
    return json.loads((BOUNDS / request.param).read_text())


def silenced(doc):
    out = copy.deepcopy(doc)
    for key, metrics in out["bounds"].items():
        if key.split("/")[1] in ("outputs", "grads"):
            for entry in metrics.values():
                entry["control_error"] = 0.0
    return out


def test_the_committed_families_measured_something(committed):
    assert silent_controls(committed) is None


def test_a_family_whose_controls_reproduced_r0_bit_for_bit_is_named(committed):
    warning = silent_controls(silenced(committed))
    assert warning is not None and warning.startswith(f"{committed['role']} {committed['family']}: every control")
    assert "reference.perturbations" in warning


def test_one_control_error_anywhere_is_enough(committed):
    doc = silenced(committed)
    key = next(k for k in doc["bounds"] if k.split("/")[1] == "grads")
    next(iter(doc["bounds"][key].values()))["control_error"] = 1e-9
    assert silent_controls(doc) is None
