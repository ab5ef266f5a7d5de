"""The reference replayed on another run's clip decisions (qualify.ppo.decisions).

When a candidate decides a token's clip otherwise than the reference (a token within a rounding step of a clip
edge), its later steps follow another trajectory than the reference's, and comparing them with the reference's
would measure the branch, not the numerics. The judge then compares the candidate with this replay: the same
reference run (precision, r0: the independent HF model, the same code and settings) with every token's decision
imposed from the candidate's recorded outputs, step by step. Nothing else is taken from the candidate.

The bounds are calibrated the same way: a reference control that decided a token otherwise than the r0 it is
compared with enters freeze through its error against that r0 replayed on the control's decisions, made by the
reference stage (control_replays) and sealed under reference/replays/, inside the acceptance's evidence. So a bound
measures numerics with the decisions held equal, which is what the case's tensors are judged on; the decisions
themselves are judged as decisions (qualify.judge.decided).

Replays are keyed by the imposed decisions, the targets and the matrix's scoring settings: a case's replay is
sealed under candidates/replays/<precision>-r0-<key>/<role>/ unless the reference already holds the same one (a case
that decided as a control did), so the cases that decide alike share one and the report's re-judging reads it back
instead of computing it again.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from qualify.compare import RunTensors, load_steps, num_steps, step_dir
from qualify.errors import EvidenceError
from qualify.layout import replays_dir
from qualify.matrix import Objective
from qualify.ppo.decisions import Decisions, decisions, differing
from qualify.reference.context import ScoringContext
from qualify.reference.inputs import StepInputs
from qualify.runname import RunName
from qualify.stages import stage_is_complete


def replay_dir(root: Path, precision: str, role: str, decided: list[torch.Tensor], settings: str) -> Path:
    """root/replays/<precision>-r0-<key>/<role>: root is the reference directory (the controls' replays, sealed
    before freeze) or the candidates directory (the cases')."""
    h = hashlib.sha256(f"{precision}\0{role}\0{settings}\0".encode())
    for mask in decided:
        h.update(str(tuple(mask.shape)).encode())
        h.update(mask.to(torch.uint8).contiguous().numpy().tobytes())
    return replays_dir(root) / f"{precision}-r0-{h.hexdigest()[:16]}" / role


def replay_location(ctx: ScoringContext, precision: str, role: str, decided: list[torch.Tensor],
                    into: Path | None = None) -> Path:
    """Where <precision>-r0 replayed with decided[k] imposed at step k is sealed: the reference's own replay when a
    control decided alike, else the one under into (default the candidates directory)."""
    frozen = replay_dir(ctx.layout.reference, precision, role, decided, ctx.settings)
    if stage_is_complete(frozen):
        return frozen
    return replay_dir(ctx.layout.candidates if into is None else into, precision, role, decided, ctx.settings)


def sealed_replay(ctx: ScoringContext, precision: str, role: str, decided: list[torch.Tensor],
                  into: Path | None = None) -> tuple[list[RunTensors], Path]:
    """(the steps of the sealed replay, where it is): read only, never computed here (ensure_replay makes it, as its
    own step before anything is judged); a replay that is not sealed is an EvidenceError."""
    where = replay_location(ctx, precision, role, decided, into)
    if not stage_is_complete(where):
        raise EvidenceError(f"{where} is not sealed: {precision}-r0 {role} replayed on these clip decisions is made "
                            "by 'qualify candidate' before judging (run it again on this run directory)")
    return load_steps(where), where


def ensure_replay(ctx: ScoringContext, precision: str, role: str, decided: list[torch.Tensor],
                  into: Path | None = None) -> Path:
    """Where the replay is sealed, made here (the reference model scored again) when it is not."""
    where = replay_location(ctx, precision, role, decided, into)
    if not stage_is_complete(where):
        make_replay(ctx, precision, role, decided, where)
    return where


def make_replay(ctx: ScoringContext, precision: str, role: str, decided: list[torch.Tensor], out: Path) -> Path:
    """Score <precision>-r0 with decided[k] imposed at step k and seal it in out (nothing done when it is sealed)."""
    from qualify.reference.evidence import write_role

    if stage_is_complete(out):
        return out
    result, info = run_replay(ctx, precision, role, decided)
    write_role(out, result, info)
    return out


def run_replay(ctx: ScoringContext, precision: str, role: str,
               decided: list[torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(run_role's result, the meta it is sealed with) of <precision>-r0 scored again with decided[k] imposed at step
    k: what make_replay seals, and what a control's record uses in memory when it fits
    (qualify.reference.summary.aligned_base)."""
    from qualify.models.hf import load_model
    from qualify.reference.evidence import load_targets, model_config
    from qualify.reference.step import Control, run_role
    from qualify.rollout.capture import load_rollout

    models = ctx.models
    rollout = load_rollout(ctx.layout.rollout(ctx.primary_tp), ctx.rollout_digest)
    targets = load_targets(ctx.layout, ctx.targets_digest)
    control = Control(name="r0")
    started = time.monotonic()
    master = load_model(models[role], role, control.attn_impl)
    with torch.enable_grad():
        result = run_role(ctx, role, precision, control, master, rollout, targets,
                          model_config(models["actor"])["vocab_size"], models[role], decided=decided)
    return result, {"precision": precision, "control": "r0", "role": role, "replay": "decisions",
                    "attn_impl": control.attn_impl, "seconds": round(time.monotonic() - started, 3),
                    "rollout_digest": ctx.rollout_digest, "targets_digest": ctx.targets_digest,
                    "settings": ctx.settings}


def recorded_decisions(objective: Objective, role: str, directory: Path, inputs: StepInputs) -> list[Decisions | None]:
    """The clip decisions of every step of a sealed run, from its recorded outputs alone."""
    from qualify.store import read_tensors

    return step_decisions(objective, role, [read_tensors(Path(directory) / step_dir(k) / "outputs.safetensors")
                                         for k in range(num_steps(directory))], inputs)


def step_decisions(objective: Objective, role: str, outputs: list[dict[str, torch.Tensor]],
                   inputs: StepInputs) -> list[Decisions | None]:
    """The clip decisions of every step from each step's outputs (None for a step past the inputs' steps)."""
    return [None if k >= len(inputs.masks) else
            decisions(role, objective.ppo, objective.grpo, out, inputs.targets[k], inputs.masks[k])
            for k, out in enumerate(outputs)]


def replay_needed_for(mine: list[Decisions | None], theirs: list[Decisions | None]) -> list[torch.Tensor] | None:
    """The decisions to impose on r0 so that it decides as a control did (mine); None when the control decided as
    r0 (theirs) at every step, or some step's decisions cannot be read (it is then compared with r0 itself)."""
    if any(d is None for d in mine + theirs) or len(mine) != len(theirs):
        return None
    if not any(differing(a, b) for a, b in zip(mine, theirs)):
        return None
    return [d.clipped_BT for d in mine]


def control_replay(ctx: ScoringContext, role: str, base: str, control: str,
                   inputs: StepInputs) -> tuple[Path, list[torch.Tensor]] | None:
    """(where base, '<precision>-r0', replayed on the control's decisions is sealed in the reference, the decisions)
    when the control ('<precision>-<name>') decided a token otherwise than base at some step; None when it never did
    (or its decisions cannot be read: such a control is compared with base itself)."""
    precision, name = RunName.parse(base)
    if name != "r0":
        raise ValueError(f"a replay is of an r0 run, not {base}")
    layout, objective = ctx.layout, ctx.objective
    decided = replay_needed_for(recorded_decisions(objective, role, layout.scores(*RunName.parse(control), role),
                                                   inputs),
                                recorded_decisions(objective, role, layout.scores(precision, "r0", role), inputs))
    return None if decided is None else (replay_dir(layout.reference, precision, role, decided, ctx.settings),
                                         decided)


def control_replays(ctx: ScoringContext, controls: list[str],
                    step: Callable[[str], object] | None = None) -> Iterator[Path]:
    """Make every replay freeze needs: for each role and family, r0 replayed on each control's decisions where they
    differ from r0's (qualify.bounds.rule.family_pairs). step(text) wraps each computation (a StageLog step)."""
    from contextlib import nullcontext

    from qualify.bounds.records import read_record
    from qualify.bounds.rule import FAMILIES, family_pairs
    inputs = ctx.inputs()
    for role in ctx.objective.roles:
        for family in FAMILIES:
            base, others = family_pairs(family, controls)
            for other in others:
                if read_record(ctx.layout.scores(*RunName.parse(other), role)) is not None:
                    continue  # kept as a summary: measured against its replay while it ran (qualify.reference.summary)
                found = control_replay(ctx, role, base, other, inputs)
                if found is None:
                    continue
                out, decided = found
                if not stage_is_complete(out):
                    with (step(f"replay {base} {role} on {other}'s clip decisions") if step else nullcontext()):
                        make_replay(ctx, RunName.parse(base).precision, role, decided, out)
                yield out
