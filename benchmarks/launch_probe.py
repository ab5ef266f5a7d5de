"""Where a candidate launch's start-up goes, and torchrun against qualify's direct rank start, in one run.

Driver: python benchmarks/launch_probe.py ab ENGINE TP MODEL_DIR OUT_JSONL [--repeats N]
  launches ENGINE's start-up at TP ranks, alternating QUALIFY_LAUNCHER=torchrun and the direct start
  (qualify.case.launch.run_ranks, the default), N times each; every rank prints the seconds since the launch began at
  which it reached each phase; the driver adds the launch's whole wall time (teardown included).
Rank:   python benchmarks/launch_probe.py rank ENGINE MODEL_DIR   (started by the driver)
  phases: python up, torch imported, qualify's worker imported, the engine's framework imported, NCCL process
  group up (first barrier done), engine.setup() done on MODEL_DIR (bf16 actor: model load, TP sharding, optimizer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

T0 = float(os.environ.get("PROBE_T0", "0"))
STARTED = time.time()


def rank(engine: str, model_dir: str) -> None:
    marks = {"python": STARTED - T0}

    def mark(name: str) -> None:
        marks[name] = time.time() - T0

    import torch
    import torch.distributed as dist

    mark("torch")
    import qualify.candidate.worker

    mark("worker")
    if engine == "megatron":
        import megatron.core  # noqa: F401

        import qualify.engines.megatron  # noqa: F401
    elif engine == "deepspeed":
        import deepspeed  # noqa: F401
    else:
        import torch.distributed.tensor.parallel
        import transformers  # noqa: F401
    mark("engine_import")
    local = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()  # no GPU: gloo on the CPU (to try the probe itself)
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    dist.barrier()
    mark("process_group")

    from qualify.engines.base import EngineContext
    from qualify.engines.registry import get_engine
    from qualify.matrix import Optimizer

    tp = dist.get_world_size()
    ctx = EngineContext(role="actor", precision="bf16", tp=tp, rank=dist.get_rank(), device=f"cuda:{local}" if cuda else "cpu",
                        model_dir=Path(model_dir), optimizer=Optimizer(), temperature=1.0, logprob_chunk_tokens=1024,
                        vocab_size=json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"],
                        work_dir=Path(f"/tmp/launch-probe-{engine}-{tp}"))
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    e = get_engine(engine)
    e.setup(ctx)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    mark("setup")
    e.close()
    if dist.get_rank() == 0:
        print("PROBE " + json.dumps({k: round(v, 3) for k, v in marks.items()}), flush=True)
    dist.destroy_process_group()


def ab(engine: str, tp: int, model_dir: str, out: str, repeats: int) -> None:
    from qualify.case.launch import run_ranks

    here = os.path.abspath(__file__)
    for i in range(repeats):
        for launcher in ("torchrun", "direct"):
            env = dict(os.environ, PROBE_T0=repr(time.time()))
            cmd = [sys.executable, here, "rank", engine, model_dir]
            log = f"/tmp/launch-probe-{engine}-{tp}-{launcher}-{i}.log"
            with open(log, "w") as f:
                if launcher == "torchrun":
                    code = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                           f"--nproc-per-node={tp}", *cmd[1:]], check=False, env=env, stdout=f,
                                          stderr=subprocess.STDOUT).returncode
                else:
                    code = run_ranks(cmd, tp, env, f)
            wall = time.time() - float(env["PROBE_T0"])
            text = Path(log).read_text()
            marks = next((json.loads(line.split("PROBE ", 1)[1]) for line in text.splitlines() if "PROBE " in line), {})
            row = {"engine": engine, "tp": tp, "launcher": launcher, "repeat": i, "exit": code,
                   "wall_s": round(wall, 3), **marks}
            if code:
                row["log_tail"] = text[-1500:]
            print(json.dumps(row), flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank(sys.argv[2], sys.argv[3])
    else:
        repeats = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 2
        ab(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], repeats)
