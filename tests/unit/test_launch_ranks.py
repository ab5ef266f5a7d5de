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
