"""Judging and freeze read a run tensor by tensor (qualify.store.TensorFile) and measure each pair once
(qualify.metrics.pair_values), on the GPU when there is one: the same numbers as reading whole files and measuring
metric by metric, checked here against those functions and plain torch."""

from __future__ import annotations

import math

import pytest
import torch

from qualify import metrics
from qualify.compare import RunTensors, load_run, pair_metrics, structure_problems, write_step
from qualify.errors import EvidenceError
from qualify.store import TensorFile, read_tensors, tensor_spec, write_json, write_tensors

SHAPES = [(1,), (7,), (3, 5), (64, 33), (2, 3, 4)]


def pair(shape, seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(shape, generator=g)
    return r + 1e-3 * torch.randn(shape, generator=g), r


@pytest.mark.parametrize("shape", SHAPES)
def test_pair_values_are_the_metrics_one_by_one_bit_for_bit(shape):
    c, r = pair(shape, sum(shape))
    got = metrics.pair_values(c, r, metrics.PAIR_METRICS)
    assert got == {"max_abs": metrics.max_abs(c, r), "rel_l2": metrics.rel_l2(c, r),
                   "mean_abs": metrics.mean_abs(c, r), "p99_abs": metrics.p99_abs(c, r)}
    d = (c.double() - r.double()).abs().flatten()  # and against plain torch
    assert got["max_abs"] == float(d.max())
    assert got["p99_abs"] == float(d.sort().values[math.ceil(0.99 * d.numel()) - 1])


def test_pair_values_of_a_broken_or_empty_pair():
    c, r = pair((4,), 1)
    c[2] = float("nan")
    assert metrics.pair_values(c, r, ("max_abs", "mean_abs")) == {"max_abs": math.inf, "mean_abs": math.inf}
    assert metrics.pair_values(torch.zeros(0), torch.zeros(0), ("max_abs", "rel_l2")) == {"max_abs": 0.0, "rel_l2": 0.0}
    with pytest.raises(ValueError, match="unknown metric 'l1'"):
        metrics.pair_values(*pair((3,), 2), ("l1",))


def test_the_metrics_device_follows_the_environment(monkeypatch):
    monkeypatch.setenv("QUALIFY_METRICS_DEVICE", "cpu")
    assert metrics.metrics_device() == torch.device("cpu")
    monkeypatch.setenv("QUALIFY_METRICS_DEVICE", "auto")
    assert metrics.metrics_device() == (torch.device("cuda") if torch.cuda.is_available() else None)


@pytest.mark.gpu
def test_pair_values_on_the_gpu_agree_with_the_host():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    c, r = pair((1000, 257), 3)
    host, gpu = (metrics.pair_values(c, r, metrics.PAIR_METRICS, d) for d in (None, torch.device("cuda")))
    assert host["max_abs"] == gpu["max_abs"] and host["p99_abs"] == gpu["p99_abs"]  # exact anywhere
    for name in ("mean_abs", "rel_l2"):  # sums: the last float64 bits may differ
        assert gpu[name] == pytest.approx(host[name], rel=1e-12)


def test_a_tensor_file_reads_what_the_whole_file_holds_one_tensor_at_a_time(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.arange(6),
               "d": torch.tensor([True, False])}
    write_tensors(tmp_path / "t.safetensors", tensors)
    lazy, whole = TensorFile(tmp_path / "t.safetensors"), read_tensors(tmp_path / "t.safetensors")
    assert list(lazy) == list(whole) and len(lazy) == 4 and "a" in lazy and "z" not in lazy
    for name, t in tensors.items():
        assert torch.equal(lazy[name], t) and lazy[name].dtype == t.dtype
        assert tensor_spec(lazy, name) == tensor_spec(whole, name) == (tuple(t.shape), t.dtype)
    with pytest.raises(KeyError):
        lazy["z"]


def test_a_missing_or_garbled_tensor_file_is_an_evidence_error(tmp_path):
    with pytest.raises(EvidenceError, match="missing tensor file"):
        TensorFile(tmp_path / "none.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(EvidenceError, match="not a readable safetensors file"):
        TensorFile(tmp_path / "bad.safetensors")


def run_on_disk(tmp_path, name, seed, grad_shape=(6, 4)):
    g = torch.Generator().manual_seed(seed)
    step = {"outputs": {"loss": torch.randn((), generator=g), "logprobs_BT": torch.randn(2, 5, generator=g)},
            "grads": {"w": torch.randn(grad_shape, generator=g), "b": torch.randn(4, generator=g)},
            "updates": {"w": torch.randn(grad_shape, generator=g), "b": torch.randn(4, generator=g)},
            "moments": {"exp_avg/w": torch.randn(grad_shape, generator=g),
                        "exp_avg_sq/w": torch.rand(grad_shape, generator=g)}}
    write_step(tmp_path / name / "step0", step)
    write_json(tmp_path / name / "meta.json", {"num_steps": 1})
    return step


def test_a_run_read_tensor_by_tensor_is_measured_as_one_read_whole(tmp_path):
    steps = [run_on_disk(tmp_path, n, s) for n, s in (("c", 1), ("r", 2))]
    lazy_c, lazy_r = load_run(tmp_path / "c"), load_run(tmp_path / "r")
    assert isinstance(lazy_c.grads, TensorFile) and isinstance(lazy_c.moments, TensorFile)
    whole_c, whole_r = (RunTensors(**s) for s in steps)
    assert pair_metrics(lazy_c, lazy_r) == pair_metrics(whole_c, whole_r)
    assert pair_metrics(lazy_c, lazy_r)["grads/w"]["max_abs"] == float(
        (steps[0]["grads"]["w"].double() - steps[1]["grads"]["w"].double()).abs().max())


def test_structure_problems_read_from_the_header_name_a_reshaped_gradient(tmp_path):
    run_on_disk(tmp_path, "c", 1, grad_shape=(4, 6))
    run_on_disk(tmp_path, "r", 2)
    problems = structure_problems(load_run(tmp_path / "c"), load_run(tmp_path / "r"))
    assert ("grads/w", "shape (4, 6) != (6, 4)") in problems
    assert "grads/w" not in pair_metrics(load_run(tmp_path / "c"), load_run(tmp_path / "r"))


def test_judging_a_run_read_from_disk_never_reads_a_whole_tensor_group(tmp_path, monkeypatch):
    """The judge's pair (structure, metrics, AdamW replay) reads gradients, moments and updates one tensor at a time:
    loading a whole group file is refused here, and the rows are still all made."""
    from safetensors import torch as st

    from qualify.judge.steps import judge_pair
    from tests.unit._runs import OPT

    run_on_disk(tmp_path, "c", 1)
    run_on_disk(tmp_path, "r", 2)
    real = st.load_file

    def only_outputs(path, *args, **kwargs):
        assert str(path).endswith("outputs.safetensors"), f"a whole group was read: {path}"
        return real(path, *args, **kwargs)
    monkeypatch.setattr(st, "load_file", only_outputs)
    cand, ref = load_run(tmp_path / "c"), load_run(tmp_path / "r")
    bounds = {"grads/w": {"max_abs": {"bound": 1.0}}, "updates/w": {"replay_max_abs": {"bound": 1.0}}}
    start = {"w": torch.zeros(6, 4), "b": torch.zeros(4)}
    rows = judge_pair("c", "actor", "cmp", cand, ref, bounds, start, OPT)
    assert {(r.tensor, r.metric) for r in rows} == {("grads/w", "max_abs"), ("updates/w", "replay_max_abs")}
    assert all(math.isfinite(r.value) for r in rows)
