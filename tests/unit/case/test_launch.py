"""qualify.case.launch.run_ranks: every rank gets torchrun's variables; the first rank to fail stops the others."""

from __future__ import annotations

import sys
import time

from qualify.case.launch import run_ranks

SHOW = "import os; print('rank', os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'], " \
       "os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])"


def test_every_rank_gets_its_variables_and_one_port(tmp_path):
    log_path = tmp_path / "log"
    with open(log_path, "w") as log:
        assert run_ranks([sys.executable, "-c", SHOW], 3, {"PATH": ""}, log) == 0
    lines = sorted(log_path.read_text().split("\n")[:3])
    assert [line.split()[1:4] for line in lines] == [["0", "0", "3"], ["1", "1", "3"], ["2", "2", "3"]]
    assert len({line.split()[-1] for line in lines}) == 1 and all("127.0.0.1" in line for line in lines)


def test_a_failed_rank_stops_the_others_and_its_code_is_returned(tmp_path):
    code = "import os, sys, time; r = int(os.environ['RANK']); time.sleep(0 if r == 1 else 60); sys.exit(7 if r == 1 else 0)"
    started = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        assert run_ranks([sys.executable, "-c", code], 2, {"PATH": ""}, log) == 7
    assert time.monotonic() - started < 30  # rank 0 was stopped, not waited for


def test_gpu_shortfall_names_the_ranks_and_the_visible_gpus(monkeypatch):
    from qualify.case.ranks import gpu_shortfall

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpu_shortfall(1, visible=1) is None and gpu_shortfall(2, visible=4) is None
    why = gpu_shortfall(2, visible=1)
    assert why.startswith("2 ranks on cuda need 2 GPUs on this host, 1 visible (CUDA_VISIBLE_DEVICES='0')")
    assert "reference.device: cpu" in why


def test_a_cuda_launch_with_too_few_gpus_starts_no_rank_and_says_why(tmp_path, monkeypatch):
    """A TP2 case on a host with fewer GPUs than ranks (a one-GPU machine, or none) is refused before any rank
    starts, with the reason in its log (failure_note shows it), not CUDA's 'invalid device ordinal' from rank 1."""
    import torch

    from qualify.case.launch import failure_note, start_module

    monkeypatch.setenv("QUALIFY_LAUNCHER", "direct")
    ranks = torch.cuda.device_count() + 1
    marker = tmp_path / "started"
    log_path = tmp_path / "launch.log"
    code = start_module("this_module_does_not_exist_qualify", [str(marker)], ranks, "cuda", {"PATH": ""}, log_path)
    assert code == 2 and not marker.exists()
    note = failure_note(tmp_path, log_path, code)
    assert f"not launched: {ranks} ranks on cuda need {ranks} GPUs on this host" in note
    assert "No module named" not in log_path.read_text()  # nothing was started
