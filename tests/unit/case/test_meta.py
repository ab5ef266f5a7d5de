"""qualify.case.meta.CaseMeta: a case's meta.json read and written back key for key, byte for byte, whether the
document is one the worker writes (qualify.candidate.worker.case_meta: its own code path) or one in the form a sealed
case holds (optional keys absent or present, non-finite numbers as strings, null derivations)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from qualify.candidate import worker
from qualify.case.meta import KEYS, CaseMeta, read_case_meta
from qualify.case.spec import make_spec
from qualify.errors import EvidenceError
from qualify.store import dumps_json, json_safe, read_json, write_json
from tests.unit._runs import synthetic_matrix

WRITTEN_ORDER = ["grad_dtypes", "state_dtypes", "replica_max_abs", "padded_rows", "padding", "extra_params",
                 "num_steps", "own_objective", "contract", "sampler_derivation", "layout", "entropy_derivation",
                 "routing_replay", "rollout_layers", "case", "seconds", "phases_s", "versions", "host", "platform",
                 "slurm"]
"""The keys the worker writes, in its order (the optional three only where they apply)."""


class _Engine:
    """What case_meta asks of an engine: whether it brings its own objective."""


def _spec(tmp_path):
    matrix = synthetic_matrix(tmp_path)
    case = matrix.cases()[0]
    return make_spec(matrix.case_settings, case, model_dir=tmp_path / "model", rollout_dir=tmp_path / "rollout",
                     targets_dir=tmp_path / "targets", rollout_digest="sha256:" + "1" * 64,
                     targets_digest="sha256:" + "2" * 64, case_dir=tmp_path / "case", vocab_size=64, device="cpu")


def _trace(entropy: bool, replayed: bool, layers: bool) -> worker.Trace:
    trace = worker.Trace(phases={"setup": 0.25, "layout probe": 0.125, "steps": 1.5})
    trace.steps = [{}, {}]
    trace.grad_dtypes = {"w": "float32", "b": "bfloat16"}
    trace.params = {"w": torch.zeros(2), "b": torch.zeros(1), "extra": torch.zeros(1)}
    trace.state = {"exp_avg": {"w": torch.zeros(2), "b": torch.zeros(1, dtype=torch.bfloat16)}}
    trace.replayed = [{"pairs": 4, "differ": 0, "first": None}] if replayed else []
    trace.exact_layers = {"layers": []} if layers else None
    trace.entropies = [None] if entropy else []
    return trace


def _ranks(entropy: bool, replayed: bool, layers: bool) -> dict:
    worst = {"value": math.nan, "bound": 1e-6, "row": 0, "position": 3, "case": math.inf, "derived": 0.5,
             "ratio": math.inf}
    return {"replicas": {"w": 0.0, "b": math.nan}, "padded": {"embed@rank0": {"rows": 0, "changed_max_abs": 0.0}},
            "padding": [{"found": {}, "exposed": 0}], "sampler": [[worst, None]],
            "entropy": [[None]] if entropy else None,
            "replayed": [[{"pairs": 4, "differ": 0, "first": None}]] if replayed else [[]],
            "layout": [{"one row": {"num_tokens": 8, "num_not_bitwise": 0, "max_abs": 0.0}}],
            "layers": [{"layers": [], "skipped": "no layers"}] if layers else [None]}


@pytest.mark.parametrize("optional", [(False, False, False), (True, True, True), (True, False, True)])
def test_a_meta_written_by_the_workers_code_path_reads_back_byte_for_byte(tmp_path, optional):
    spec = _spec(tmp_path)
    meta = worker.case_meta(spec, _Engine(), _trace(*optional), _ranks(*optional), {"w": None, "b": None},
                            {"contract": "agreed"}, started=0.0)
    path = tmp_path / "case" / "meta.json"
    path.parent.mkdir()
    write_json(path, json_safe(meta.to_json()))  # as the worker writes it
    doc = read_json(path)
    expected = [k for k in WRITTEN_ORDER if k not in ("entropy_derivation", "routing_replay", "rollout_layers")
                or dict(zip(("entropy_derivation", "routing_replay", "rollout_layers"), optional))[k]]
    assert list(meta.to_json()) == expected
    read = read_case_meta(path.parent)
    assert read.to_json() == doc
    assert dumps_json(read.to_json()).encode("ascii") == path.read_bytes()
    assert read.extra_params == ["extra"] and read.state_dtypes == {"w": "float32", "b": "bfloat16"}
    assert read.case == spec.to_json() and read.spec["name"] == spec.name


def test_a_sealed_cases_meta_round_trips():
    """The form a sealed case's meta.json holds: optional keys absent, non-finite numbers as strings, a null
    derivation, the provenance last."""
    doc = {"grad_dtypes": {"lm_head.weight": "float32"}, "state_dtypes": {"lm_head.weight": "float32"},
           "replica_max_abs": {"norm.weight": "nan"}, "padded_rows": {}, "padding": [{"exposed": 0, "found": {}}],
           "extra_params": [], "num_steps": 2, "own_objective": False, "contract": {"tp": 1},
           "sampler_derivation": None, "layout": {}, "routing_replay": [None, {"differ": 0, "pairs": 8, "first": None}],
           "case": {"name": "torch-tp-fp32-tp1-actor", "determinism": "bitwise"}, "seconds": 1.5,
           "phases_s": {"setup": 0.5}, "versions": {"torch": "2"}, "host": {"hostname": "h"}, "platform": {"cpu": "x"},
           "slurm": None}
    meta = CaseMeta.from_json(json.loads(json.dumps(doc)))
    assert meta.to_json() == doc and list(meta.to_json()) == list(doc)
    assert meta.entropy_derivation is None and meta.rollout_layers is None and meta.routing_replay == doc["routing_replay"]
    assert meta.spec.get("determinism") == "bitwise" and CaseMeta.of(meta) is meta
    assert set(KEYS) == set(WRITTEN_ORDER)


def test_a_case_directorys_steps_carry_its_meta_read_back_as_the_cases(tmp_path):
    """The judge reads a case's meta.json from its steps (qualify.compare.load_steps: a RoleMeta holding the
    document): CaseMeta.of gives the meta read_case_meta reads, and both give the document back key for key."""
    from qualify.compare import load_steps, write_step

    spec = _spec(tmp_path)
    meta = worker.case_meta(spec, _Engine(), _trace(True, True, True), _ranks(True, True, True),
                            {"w": None, "b": None}, {"contract": "agreed"}, started=0.0)
    case_dir = tmp_path / "case"
    write_json(case_dir / "meta.json", json_safe(meta.to_json()))
    for k in range(meta.num_steps):
        write_step(case_dir / f"step{k}", {"outputs": {"loss": torch.zeros(())}, "grads": {}, "updates": {},
                                           "moments": {}})
    steps = load_steps(case_dir)
    read = read_case_meta(case_dir)
    assert len(steps) == 2 and all(CaseMeta.of(s.meta) == read for s in steps)
    assert CaseMeta.of(steps[0].meta).to_json() == steps[0].meta.to_json() == read_json(case_dir / "meta.json")
    assert list(CaseMeta.of(steps[0].meta).to_json()) == list(read.to_json())
    assert dumps_json(CaseMeta.of(steps[0].meta).to_json()).encode("ascii") == (case_dir / "meta.json").read_bytes()


def test_a_meta_with_a_key_no_case_has_is_refused_naming_it():
    with pytest.raises(EvidenceError, match="evidence"):
        CaseMeta.from_json({"num_steps": 1, "evidence": "lean"})
    with pytest.raises(EvidenceError, match="list"):
        CaseMeta.from_json([])
