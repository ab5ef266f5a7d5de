"""One actor training step of a round, by the candidate engine, through the candidate stage's own launcher.

The step is a candidate case (engine x rounds.train_precision x TP x actor) on the round's rollout and targets,
launched exactly as `qualify candidate` launches it (qualify.case.launch) (its K = epochs x minibatches
optimizer steps); the next version is made from the sum of its steps' updates (new - old fp32
parameters in HF names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qualify.case.launch import launch, log_tail, write_spec_file
from qualify.case.ranks import device_of
from qualify.case.spec import make_spec
from qualify.compare import load_steps
from qualify.engines.registry import preload_modules
from qualify.errors import EvidenceError, RoundsError
from qualify.hashing import file_digest
from qualify.layout import launch_log
from qualify.matrix import Case, CaseSettings
from qualify.stages import stage_is_complete
from qualify.tensor_codec import decoding

WORKER = "qualify.candidate.worker"
"""The module a round's training step runs (python -m): the candidate stage's worker, started by name."""


class TrainFailed(RoundsError):
    """The trainer's launch failed (the message holds its log's tail)."""


def check_digest(path: Path, expected: str, what: str) -> None:
    actual = file_digest(path)
    if actual != expected:
        raise EvidenceError(f"{what} {path} has digest {actual}, expected {expected}")


def train_step(settings: CaseSettings, *, engine: str, tp: int, model_dir: Path, rollout_dir: Path, rollout_digest: str,
               targets_dir: Path, targets_digest: str, out: Path, vocab_size: int,
               precision: str = "fp32") -> dict[str, Any]:
    """Run the actor step into out (skipped when complete); return its updates and seconds."""
    check_digest(Path(targets_dir) / "targets.safetensors", targets_digest, "targets")
    case = Case(engine=engine, precision=precision, tp=tp, role="actor")
    device = device_of(settings.reference)
    if not stage_is_complete(out):
        spec = make_spec(settings, case, model_dir=model_dir, rollout_dir=rollout_dir, targets_dir=targets_dir,
                         rollout_digest=rollout_digest, targets_digest=targets_digest, case_dir=out,
                         vocab_size=vocab_size, device=device)
        spec_path = write_spec_file(spec)
        code = launch(WORKER, spec_path, tp, device, launch_log(out), preload_modules(engine))
        if code != 0 or not stage_is_complete(out):
            raise TrainFailed(f"{case.name} step failed: {log_tail(launch_log(out), code)}")
    with decoding():  # each step's coded updates decoded from the step before's, kept while they are summed
        steps = load_steps(Path(out))
        updates: dict[str, torch.Tensor] = {n: sum((s.updates[n] for s in steps[1:]), steps[0].updates[n])
                                            for n in steps[0].updates}
    last = steps[-1].outputs
    return {"case": case.name, "updates": updates, "num_steps": len(steps), "loss": float(last["loss"]),
            "grad_norm": float(last["grad_norm"])}
