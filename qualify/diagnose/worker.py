"""One rank of a diagnose launch (started as a candidate case's: qualify.case.launch): its per-layer activations at step 1.

The engine is set up exactly as its candidate case was (the case's own spec.json, the context
qualify.candidate.worker.run_case gives it, on the case's tp x dp ranks) and runs one forward of the first
optimizer step's rows through its optional layer_outputs hook: each DP rank its own rows, as in the case, gathered
in rank order (the step's rows in their own order); rank 0 seals the full fp32 tensors. An engine without the hook
seals an empty file and says so in the seal (gradients are still diagnosed from the case's evidence).
Usage: python -m qualify.diagnose.worker SPEC.json OUT_DIR KEY   (KEY: the case seal's fingerprint)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from qualify.bounds.layers import LAYERS_FILE
from qualify.case.ranks import init_distributed
from qualify.case.spec import case_batch, engine_context, read_spec
from qualify.engines.registry import get_engine
from qualify.judge.dp import dp_group, gather_outputs, rank_rows
from qualify.layout import work_dir
from qualify.ppo.objective import step_rows
from qualify.rollout.capture import load_rollout
from qualify.stages import complete_stage, prepare_stage
from qualify.store import write_tensors


def main() -> None:
    spec, out = read_spec(Path(sys.argv[1])), Path(sys.argv[2])
    key = sys.argv[3] if len(sys.argv) > 3 else ""
    rank = init_distributed(spec)
    rollout = load_rollout(Path(spec.rollout_dir), spec.rollout_digest)
    step = step_rows(rollout["input_ids_BT"].shape[0], spec.ppo.epochs, spec.ppo.minibatches)[0]
    work = work_dir(out)
    work.mkdir(parents=True, exist_ok=True)
    engine = get_engine(spec.engine)
    ctx = engine_context(spec, rank, work)
    group = dp_group(spec.tp, spec.dp, rank)  # before the engine's own groups, as in the case
    rows, _ = rank_rows(step, spec.dp, ctx.dp_rank)
    batch = case_batch(spec, rollout, rows)
    engine.setup(ctx)
    hook = getattr(engine, "layer_outputs", None)
    acts = {} if hook is None else {n: t.detach().float().cpu().contiguous() for n, t in hook(batch).items()}
    acts = gather_outputs(acts, group)  # every DP rank's rows, in rank order: the step's
    engine.close()
    if rank == 0:
        prepare_stage(out)
        write_tensors(out / LAYERS_FILE, acts)
        complete_stage(out, {"case": spec.name, "engine": spec.engine, "hook": hook is not None, "key": key})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
