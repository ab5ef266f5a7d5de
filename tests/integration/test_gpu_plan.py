"""The candidate stage's GPU plan on a real GPU (qualify.candidate.schedule): the budget read from the card and its
cap, launches that do not fit the capped card run one after the other to a verdict, and a real CUDA out-of-memory in
the judge is recovered from. Needs CUDA, not vLLM (the reference scores the committed rollout)."""

from __future__ import annotations

import pytest
import torch
import yaml

from qualify.stagelog import StageLog
from tests.conftest import COMMITTED, TINY
from tests.integration._support import plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU plan needs CUDA")]

GiB = 1 << 30


def test_the_budget_is_what_the_card_has_free_capped(monkeypatch):
    from qualify.candidate.schedule import CAP_ENV, gpu_budgets
    from qualify.resident import HEADROOM

    free, _ = torch.cuda.mem_get_info(0)
    assert gpu_budgets(1)[0] <= free - HEADROOM + torch.cuda.memory_reserved(0)
    monkeypatch.setenv(CAP_ENV, "9GiB")
    assert gpu_budgets(1) == {0: 9 * GiB - HEADROOM}


def test_a_real_out_of_memory_in_the_judge_is_deferred_then_judged():
    """The GPU filled but for 1 GiB by another holder; a judge that needs 2 GiB runs out of memory for real: it is
    deferred (the copies given back), and judged once the holder is gone."""
    from qualify.candidate.schedule import judged_within_memory
    from qualify.resident import Resident

    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(0)
    holder = torch.empty(free - GiB, dtype=torch.uint8, device="cuda")
    made = []

    def judge() -> None:
        made.append(torch.ones(2 * GiB // 4, dtype=torch.float32, device="cuda").sum().item())

    resident = Resident(torch.device("cuda"))
    assert judged_within_memory(judge, resident, StageLog("test"), "judge c", retry=False) is False
    assert resident.frugal and made == []
    del holder
    torch.cuda.empty_cache()
    assert judged_within_memory(judge, resident, StageLog("test"), "judge c", retry=True) is True
    assert made == [2 * GiB // 4]


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    from qualify.freeze import freeze
    from qualify.matrix import load_matrix
    from qualify.reference.stage import run_reference

    base = tmp_path_factory.mktemp("gpu-plan")
    data = yaml.safe_load(TINY.read_text())
    data["candidates"] = {"engines": ["torch-tp", "deepspeed"], "precisions": ["fp32"], "tp": [1],
                          "roles": ["actor", "critic"]}
    data["reference"]["device"] = "cuda"
    (base / "matrix.yaml").write_text(yaml.safe_dump(data))
    run_dir = base / "tiny-qwen3"
    matrix = load_matrix(base / "matrix.yaml")
    run_reference(matrix, run_dir, rollout=COMMITTED / "reference" / "rollout")
    freeze(run_dir)
    return matrix, run_dir


def test_launches_that_do_not_fit_the_capped_card_run_one_after_the_other(gpu_run, monkeypatch, capsys):
    """Capped at 9 GiB (5 GiB planned, after the headroom), two launch groups of about 2.7 GiB planned each cannot run
    together: the second waits, and every case reaches the verdict."""
    from qualify.candidate.schedule import CAP_ENV
    from qualify.candidate.stage import run_candidates

    matrix, run_dir = gpu_run
    monkeypatch.setenv(CAP_ENV, "9GiB")
    verdict = run_candidates(matrix, run_dir, launches=2)
    assert verdict.passed, [r for r in verdict.rows if not r.passed][:3]
    assert "waited for GPU memory" in capsys.readouterr().err
