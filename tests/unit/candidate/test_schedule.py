"""The candidate stage's GPU plan (qualify.candidate.schedule): launches admitted only where their estimated peak fits
beside the running ones and the judge's holdings, a retry alone, and the judge's fallback after an out-of-memory."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from qualify.candidate.schedule import (
    ESTIMATE_MARGIN,
    LaunchPlan,
    case_needs,
    judged_within_memory,
    launch_need,
    parse_bytes,
)
from qualify.matrix import Case, load_matrix
from qualify.memory import CONTEXT_BYTES, Workload, candidate_need, shape_from_config
from qualify.resident import Resident
from qualify.stagelog import StageLog

GiB = 1 << 30


def run_launches(plan: LaunchPlan, needs: list[tuple[dict[int, int], bool]], hold_s: float = 0.05) -> list[dict]:
    """Start every launch in its own thread at once; each holds its admission hold_s. Returns, sampled at every
    admission, what was planned per GPU beside what the judge held."""
    seen: list[dict] = []
    lock = threading.Lock()
    inside = [0]

    def one(need: dict[int, int], alone: bool) -> None:
        with plan.admit(need, alone=alone):
            with lock:
                inside[0] += 1
                seen.append({"running": inside[0], "alone": alone,
                             "planned": {i: plan.planned(i) + plan.judge_held(i) for i in need}})
            time.sleep(hold_s)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=one, args=(n, a)) for n, a in needs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return seen


def test_a_cpu_stage_admits_every_launch_at_once():
    plan = LaunchPlan()
    seen = run_launches(plan, [({}, False)] * 3, hold_s=0.2)
    assert max(s["running"] for s in seen) == 3 and plan.reserved() == 0 and plan.waited == 0


def test_launches_run_together_only_while_they_fit_the_budget():
    plan = LaunchPlan({0: 80 * GiB})
    seen = run_launches(plan, [({0: 34 * GiB}, False), ({0: 30 * GiB}, False), ({0: 25 * GiB}, False)])
    assert all(s["planned"][0] <= 80 * GiB for s in seen)
    assert max(s["running"] for s in seen) == 2  # two fit together, never the three
    assert plan.waited >= 1 and plan.reserved() == 0


def test_what_the_judge_holds_counts_against_the_budget():
    """The combination that crashed an 80 GB card: two launches (33.6 and 20.5 GiB) beside 24.9 GiB of judge copies.
    With the judge's holdings counted, the second launch waits; without (negative control), both run at once."""
    needs = [({0: int(33.6 * GiB)}, False), ({0: int(20.5 * GiB)}, False)]
    held = LaunchPlan({0: 76 * GiB}, judge_held=lambda i: int(24.9 * GiB))
    assert max(s["running"] for s in run_launches(held, needs)) == 1
    blind = LaunchPlan({0: 76 * GiB})
    assert max(s["running"] for s in run_launches(blind, needs)) == 2


def test_a_launch_that_fits_nowhere_still_runs_alone():
    plan = LaunchPlan({0: 10 * GiB})
    seen = run_launches(plan, [({0: 40 * GiB}, False), ({0: 40 * GiB}, False)])
    assert [s["running"] for s in seen] == [1, 1]


def test_a_retry_alone_waits_for_the_others_and_keeps_them_out():
    plan = LaunchPlan({0: 80 * GiB})
    seen = run_launches(plan, [({0: 10 * GiB}, False), ({0: 10 * GiB}, True), ({0: 10 * GiB}, False),
                               ({0: 10 * GiB}, False)])
    alone = [s for s in seen if s["alone"]]
    assert len(alone) == 1 and alone[0]["running"] == 1
    assert max(s["running"] for s in seen) >= 2  # the others did share the GPU


def test_each_gpu_of_a_launch_is_planned():
    plan = LaunchPlan({0: 40 * GiB, 1: 20 * GiB})
    seen = run_launches(plan, [({0: 15 * GiB, 1: 15 * GiB}, False), ({0: 15 * GiB, 1: 15 * GiB}, False)])
    assert max(s["running"] for s in seen) == 1  # GPU 1 has room for one of them only


def test_launch_need_is_the_largest_case_with_the_margin_on_each_rank():
    assert launch_need([10, 40, 20], 2) == {0: int(40 * ESTIMATE_MARGIN), 1: int(40 * ESTIMATE_MARGIN)}


def test_case_needs_follow_the_model(tmp_path):
    """A launch's plan is qualify.memory's estimate of its largest case, and grows with the model's shape."""
    matrix = load_matrix("matrices/tiny-qwen3.yaml")
    config = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True}
    small = dict(config, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    models = {}
    for name, cfg in (("big", config), ("small", small)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        models[name] = {"actor": tmp_path / name, "critic": tmp_path / name}
    case = Case(engine="torch-tp", precision="bf16", tp=1, role="actor")
    big = case_needs(models["big"], matrix.rollout, matrix.ppo, matrix.reference)([case])
    tiny = case_needs(models["small"], matrix.rollout, matrix.ppo, matrix.reference)([case])
    work = Workload.of(matrix.rollout, matrix.ppo, matrix.reference)
    expected = candidate_need(work, {"actor": shape_from_config(config, "actor")}, case).gpu_bytes + CONTEXT_BYTES
    assert big == {0: int(expected * ESTIMATE_MARGIN)}
    assert tiny[0] < big[0] / 5  # the tiny model: little beyond the CUDA context


@pytest.mark.parametrize("text, value", [("85899345920", 85899345920), ("80GiB", 80 * GiB), ("80 GiB", 80 * GiB),
                                         ("512MiB", 512 << 20), ("1.5GiB", int(1.5 * GiB))])
def test_the_cap_is_read_as_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["80GB", "lots", "-1", ""])
def test_a_cap_that_is_not_a_size_is_refused_naming_the_variable(text):
    with pytest.raises(ValueError, match="QUALIFY_GPU_MEMORY"):
        parse_bytes(text)


class OutOfMemoryOnce:
    """A judge whose first call runs out of GPU memory (the error torch raises), as a judge beside launches does."""

    def __init__(self, times: int = 1) -> None:
        self.calls, self.times = 0, times

    def __call__(self) -> None:
        self.calls += 1
        if self.calls <= self.times:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_an_out_of_memory_beside_launches_defers_the_case_and_gives_back_the_copies():
    resident = Resident(torch.device("cpu"))
    resident.start("actor", {"w": torch.ones(4)})
    judge = OutOfMemoryOnce()
    assert judged_within_memory(judge, resident, StageLog("test"), "judge c", retry=False) is False
    assert judge.calls == 1 and resident.kept == {} and resident.frugal


def test_an_out_of_memory_alone_is_judged_again_tensor_by_tensor():
    resident = Resident(torch.device("cpu"))
    judge = OutOfMemoryOnce()
    assert judged_within_memory(judge, resident, StageLog("test"), "judge c", retry=True) is True
    assert judge.calls == 2 and resident.frugal


def test_a_judge_that_cannot_fit_even_alone_is_not_hidden():
    judge = OutOfMemoryOnce(times=2)
    with pytest.raises(torch.OutOfMemoryError):
        judged_within_memory(judge, Resident(torch.device("cpu")), StageLog("test"), "judge c", retry=True)
