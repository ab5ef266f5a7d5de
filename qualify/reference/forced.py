"""The reference replayed on a candidate's clip decisions (qualify.ppo.decisions).

When a candidate decides a token's clip otherwise than the reference (a token within a rounding step of a clip
edge), its later steps follow another trajectory than the reference's, and comparing them with the reference's
would measure the branch, not the numerics. The judge then compares the candidate with this replay: the same
reference run (precision, r0: the independent HF model, the same code and settings) with every token's decision
imposed from the candidate's recorded outputs, step by step. Nothing else is taken from the candidate.

Replays are sealed under candidates/replays/<precision>-r0-<key>/<role>/, keyed by the imposed decisions, the
targets and the matrix's scoring settings, so the cases that decide alike share one and the report's re-judging
reads it back instead of computing it again.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

from qualify.compare import RunTensors, load_steps
from qualify.layout import RunLayout
from qualify.matrix import Matrix
from qualify.stages import stage_is_complete

REPLAYS = "replays"


def replay_dir(layout: RunLayout, precision: str, role: str, decided: list[torch.Tensor], settings: str) -> Path:
    h = hashlib.sha256(f"{precision}\0{role}\0{settings}\0".encode())
    for mask in decided:
        h.update(str(tuple(mask.shape)).encode())
        h.update(mask.to(torch.uint8).contiguous().numpy().tobytes())
    return layout.candidates / REPLAYS / f"{precision}-r0-{h.hexdigest()[:16]}" / role


def replayed_reference(matrix: Matrix, layout: RunLayout, precision: str, role: str,
                       decided: list[torch.Tensor]) -> tuple[list[RunTensors], Path]:
    """(the steps of <precision>-r0 replayed with decided[k] imposed at step k, where they are sealed)."""
    from qualify.models.family import model_dirs
    from qualify.models.hf import load_model
    from qualify.reference.stage import load_targets, model_config, scoring_settings, write_role
    from qualify.reference.step import Control, run_role
    from qualify.rollout.capture import load_rollout
    from qualify.store import read_json

    summary = read_json(layout.reference_summary)
    digest = summary["rollout_digest"]
    settings = scoring_settings(matrix, digest)
    out = replay_dir(layout, precision, role, decided, settings)
    if not stage_is_complete(out):
        models = model_dirs(matrix, layout.models)
        rollout = load_rollout(layout.rollout(matrix.rollout.vllm_tp[0]), digest)
        targets = load_targets(layout, summary["targets_digest"])
        control = Control(name="r0")
        started = time.monotonic()
        master = load_model(models[role], role, control.attn_impl)
        with torch.enable_grad():
            result = run_role(matrix, role, precision, control, master, rollout, targets,
                              model_config(models["actor"])["vocab_size"], models[role], decided=decided)
        write_role(out, result, {"precision": precision, "control": "r0", "role": role, "replay": "decisions",
                                 "attn_impl": control.attn_impl, "seconds": round(time.monotonic() - started, 3),
                                 "rollout_digest": digest, "targets_digest": summary["targets_digest"],
                                 "settings": settings})
    return load_steps(out), out

