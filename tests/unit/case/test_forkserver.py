"""qualify.case.forkserver: a rank forked from the warm server behaves as `python -m MODULE ARGS` started fresh.

It runs in its own working directory (first on sys.path) and environment, with torchrun's variables, its output in
the launch log and its exit code returned; torch uses OMP_NUM_THREADS threads as a fresh process would (the server's
own count differs: the negative control); code changed between launches is the code that runs (the server holds no
module of the working directory); the first rank to fail stops the others; and a torch computation is bitwise the
one a fresh interpreter makes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from qualify.case import forkserver
from qualify.case.launch import launcher, start_module

PROBE = """
import json, os, sys
import torch
torch.manual_seed(int(os.environ.get("SEED", "0")))
a = torch.randn(64, 257)
b = torch.randn(257, 33)
out = {"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "rank": os.environ["RANK"],
       "world": os.environ["WORLD_SIZE"], "threads": torch.get_num_threads(), "version": VERSION,
       "product": (a @ b).sum(dim=1).tolist(), "main": __name__}
with open(f"out-{os.environ['RANK']}.json", "w") as f:
    json.dump(out, f)
print("rank", os.environ["RANK"], "done")
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


def write_probe(where, version):
    (where / "probe_mod.py").write_text(f"VERSION = {version!r}\n" + PROBE)


def env_for(**extra):
    return dict(os.environ) | {"OMP_NUM_THREADS": "1"} | extra


def fork_run(tmp_path, tp=2, args=("a", "b"), **extra):
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log:
        code = forkserver.run_module_ranks("probe_mod", list(args), tp, env_for(**extra), log)
    return code, log_path.read_text()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_probe(tmp_path, 1)
    return tmp_path


def read_out(where, rank):
    return json.loads((where / f"out-{rank}.json").read_text())


def test_a_forked_rank_runs_the_module_as_python_m_would(in_tmp):
    code, log = fork_run(in_tmp)
    assert code == 0, log
    for rank in (0, 1):
        out = read_out(in_tmp, rank)
        assert out["argv"] == ["a", "b"] and out["main"] == "__main__"
        assert out["cwd"] == str(in_tmp) and out["path0"] == str(in_tmp)
        assert (out["rank"], out["world"]) == (str(rank), "2")
        assert out["threads"] == 1  # OMP_NUM_THREADS, read by the rank itself
        assert f"rank {rank} done" in log


def test_each_rank_gets_the_thread_count_of_its_own_environment(in_tmp):
    """One server, two ranks' OMP_NUM_THREADS: each rank runs with its own (the server imported torch once, with
    neither; a rank that kept the server's count would report the same number twice)."""
    counts = []
    for threads in ("1", "2"):
        assert fork_run(in_tmp, tp=1, OMP_NUM_THREADS=threads)[0] == 0
        counts.append(read_out(in_tmp, 0)["threads"])
    assert counts == [1, 2]


def test_changed_code_is_the_code_that_runs(in_tmp):
    assert fork_run(in_tmp, tp=1)[0] == 0
    assert read_out(in_tmp, 0)["version"] == 1
    write_probe(in_tmp, 2)
    assert fork_run(in_tmp, tp=1)[0] == 0
    assert read_out(in_tmp, 0)["version"] == 2


def test_exit_codes_and_the_first_failing_rank_stops_the_others(in_tmp):
    code, log = fork_run(in_tmp, tp=1, EXIT_CODE="7")
    assert code == 7, log
    (in_tmp / "probe_mod.py").write_text(
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(120)\n")
    started = time.monotonic()
    code, log = fork_run(in_tmp, tp=2)
    assert code == 3, log
    assert time.monotonic() - started < 60  # rank 0 was stopped, not waited for


def test_a_rank_that_raises_prints_its_traceback_and_exits_1(in_tmp):
    (in_tmp / "probe_mod.py").write_text("raise RuntimeError('broken rank')\n")
    code, log = fork_run(in_tmp, tp=1)
    assert code == 1
    assert "RuntimeError: broken rank" in log and "Traceback" in log


def test_a_forked_rank_computes_bitwise_what_a_fresh_one_does(in_tmp):
    assert fork_run(in_tmp, tp=1, SEED="5")[0] == 0
    forked = read_out(in_tmp, 0)["product"]
    os.remove(in_tmp / "out-0.json")
    env = env_for(SEED="5", RANK="0", WORLD_SIZE="1")
    subprocess.run([sys.executable, "-m", "probe_mod"], cwd=in_tmp, env=env, check=True, capture_output=True)
    assert read_out(in_tmp, 0)["product"] == forked


def test_another_import_environment_gets_its_own_server(in_tmp, tmp_path_factory):
    other = tmp_path_factory.mktemp("elsewhere")
    (other / "only_there.py").write_text("WHERE = 'elsewhere'\n")
    (in_tmp / "probe_mod.py").write_text("import only_there\nprint(only_there.WHERE)\n")
    path = os.pathsep.join(p for p in (str(other), os.environ.get("PYTHONPATH", "")) if p)
    code, log = fork_run(in_tmp, tp=1, PYTHONPATH=path)
    assert code == 0 and "elsewhere" in log
    assert forkserver.import_env(env_for(PYTHONPATH=path)) != forkserver.import_env(env_for())
    # the rank's own variables do not make another server
    assert forkserver.import_env(env_for(RANK="3", OMP_NUM_THREADS="7")) == forkserver.import_env(env_for())


def test_the_launcher_is_fork_on_the_cpu_direct_on_a_gpu_and_checked(monkeypatch, in_tmp):
    monkeypatch.delenv("QUALIFY_LAUNCHER", raising=False)
    assert launcher("cpu") == "fork" and launcher("cuda") == "direct"
    monkeypatch.setenv("QUALIFY_LAUNCHER", "fork")
    with pytest.raises(ValueError, match="CPU only"):
        launcher("cuda")
    monkeypatch.setenv("QUALIFY_LAUNCHER", "sometimes")
    with pytest.raises(ValueError, match="direct, fork or torchrun"):
        launcher("cpu")
    monkeypatch.setenv("QUALIFY_LAUNCHER", "direct")
    assert start_module("probe_mod", ["x"], 1, "cpu", env_for(), in_tmp / "direct.log") == 0
    assert read_out(in_tmp, 0)["argv"] == ["x"]


FSDP2_PROBE = """
import json, os
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
model.set_gradient_divide_factor(1.0)
model.set_force_sum_reduction_for_comms(True)
model(torch.full((1, 4), float(dist.get_rank() + 1))).sum().backward()
with open(f"out-{os.environ['RANK']}.json", "w") as f:
    json.dump({"bias_grad": model.bias.grad.full_tensor().tolist()}, f)
dist.destroy_process_group()
"""


def test_fsdp2_ranks_fork_from_a_server_that_preloaded_its_modules(in_tmp):
    """The fsdp2 engine's CPU ranks: the server imports its preload list (a name that does not import would be left
    out silently), and two forked ranks run fully_shard over gloo, summing the bias gradient over DP (1 + 1)."""
    from qualify.engines.registry import preload_modules

    preload = preload_modules("fsdp2")
    assert preload and set(preload) <= set(forkserver.server_for(env_for(), preload).preloaded)
    (in_tmp / "probe_mod.py").write_text(FSDP2_PROBE)
    log_path = in_tmp / "launch.log"
    with open(log_path, "w") as log:
        code = forkserver.run_module_ranks("probe_mod", [], 2, env_for(), log, preload)
    assert code == 0, log_path.read_text()
    assert [read_out(in_tmp, r)["bias_grad"] for r in (0, 1)] == [[2.0, 2.0, 2.0]] * 2
