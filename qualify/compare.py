"""What is compared between two runs (reference controls or a candidate), tensor by tensor.

A run is one role's evidence for one optimizer step: outputs (logprobs or values, losses, grad
norm), per-parameter FP32 gradients, AdamW updates and moments, in the role directory's
step<k>/ (meta.json, for all steps, beside them). pair_metrics() measures every (tensor, metric)
that a bound exists for; the same function makes the control errors at freeze time and judges the
candidates, so a bound and the value it judges are always computed the same way. Bound keys carry
the step: 'step<k>/<group>/<name>'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qualify import metrics
from qualify.layout import step_dir
from qualify.rolemeta import RoleMeta
from qualify.store import TensorFile, read_json, read_tensors, tensor_spec
from qualify.tensor_codec import StepCoding

GROUPS = ("outputs", "grads", "updates", "moments")
LEAN_GROUPS = ("outputs", "grads")
"""What a lean reference r0 keeps (reference.evidence: lean): what candidates are judged against."""
DERIVED_OUTPUTS = ("clip_frac",)
"""Outputs judged by derivation from the case's own values (qualify.judge.derived) and, token by token, by its
clip decisions (qualify.judge.decided), never against the reference's bound: a clip fraction is a count of
decisions, which a rounding tie moves by a whole token and a few controls sample poorly (a correct bf16 TP2 critic
one token off sat at half a bound made of one control's one token: benchmarks/LOG.md, the pad matrix's margins)."""
DISTRIBUTION_GROUPS = ("outputs", "grads")
"""Groups whose multi-element tensors are also judged by mean |delta| and p99 |delta|."""


@dataclass(frozen=True, slots=True)
class RunTensors:
    """One role's evidence from one run (read from disk, the gradients, updates and moments are read-only mappings
    that read a tensor when it is used)."""

    outputs: dict[str, torch.Tensor]
    grads: Mapping[str, torch.Tensor]
    updates: Mapping[str, torch.Tensor]
    moments: Mapping[str, torch.Tensor]
    meta: RoleMeta = field(default_factory=RoleMeta)
    """The directory's meta.json, typed (a case's evidence directory's read the same way; the judge reads it as the
    case's with qualify.case.meta.CaseMeta.of)."""


def write_step(directory: Path, step: dict[str, dict[str, torch.Tensor]],
               groups: tuple[str, ...] = GROUPS, coding: StepCoding | None = None) -> frozenset[str]:
    """Write one step's tensor groups (full FP32 tensors in HF names; all four unless groups says which) into
    directory. The gradients are coded (qualify.tensor_codec: bf16 values kept in bf16) and, given coding (the
    optimizer, the step before's moments, the start and new parameters), the moments and updates too; every file
    reads back the same fp32 bits. Returns the updates coded by their new parameter (the next step's
    coding.startable)."""
    from qualify.store import write_tensors
    from qualify.tensor_codec import encode_grads, encode_moments, encode_updates, param_coded

    directory, coded = Path(directory), frozenset()
    for group in groups:
        tensors, metadata = step[group], None
        if group == "grads":
            tensors, metadata = encode_grads(tensors)
        elif group == "moments" and coding is not None and "grad_norm" in step.get("outputs", {}):
            norm = float(step["outputs"]["grad_norm"].reshape(-1)[0])
            tensors, metadata = encode_moments(tensors, step["grads"], norm, coding)
        elif group == "updates" and coding is not None:
            directory.mkdir(parents=True, exist_ok=True)
            tensors, metadata = encode_updates(tensors, step.get("moments", {}), coding, directory)
            coded = param_coded(metadata)
        write_tensors(directory / f"{group}.safetensors", tensors, metadata)
    return coded


def load_run(directory: Path, step: int = 0) -> RunTensors:
    """One step of a role directory written by the reference or a candidate: its outputs read, its gradients,
    updates and moments read tensor by tensor when used (qualify.store.TensorFile), never a whole group at once."""
    d, meta = Path(directory) / step_dir(step), read_role_meta(directory)
    # a lean reference r0 (reference.evidence: lean) keeps no updates or moments: they read as empty
    kept = LEAN_GROUPS if meta.lean else GROUPS
    return RunTensors(read_tensors(d / "outputs.safetensors"),
                      *(TensorFile(d / f"{g}.safetensors") if g in kept else {} for g in GROUPS[1:]), meta)


def is_lean(meta: RoleMeta) -> bool:
    """A run kept lean: a reference r0 under reference.evidence lean (outputs and gradients only)."""
    return meta.lean


def read_role_meta(directory: Path | str) -> RoleMeta:
    """A role directory's meta.json, typed (qualify.rolemeta)."""
    path = Path(directory) / "meta.json"
    return RoleMeta.from_json(read_json(path), str(path))


def num_steps(directory: Path) -> int:
    """How many optimizer steps a role directory holds (from its meta.json)."""
    return read_role_meta(directory).num_steps


def load_steps(directory: Path) -> list[RunTensors]:
    """Every step of a role directory, in order, in memory (StepFiles reads them one at a time)."""
    return [load_run(directory, k) for k in range(num_steps(directory))]


def split_step(key: str) -> tuple[int, str]:
    """'step2/grads/x' -> (2, 'grads/x')."""
    head, _, rest = key.partition("/")
    return int(head.removeprefix("step")), rest


def with_step(step: int, metrics_by_key: dict[str, Any]) -> dict[str, Any]:
    """Prefix every key with 'step<k>/'."""
    return {f"{step_dir(step)}/{k}": v for k, v in metrics_by_key.items()}


def next_params(current: dict[str, torch.Tensor], run: RunTensors) -> dict[str, torch.Tensor]:
    """The parameters after a step: current plus the run's updates of that step (fp64, where current lies)."""
    return {n: (t + run.updates[n].to(t.device).double()) if n in run.updates and run.updates[n].shape == t.shape
            else t for n, t in current.items()}


def params_before_steps(steps: Sequence[RunTensors], initial: dict[str, torch.Tensor]) -> Sequence[dict[str, torch.Tensor]]:
    """The parameters each step of a run started from: the initial ones plus that run's own earlier updates (fp64),
    as a sequence that advances step by step and holds only the latest start (one fp64 copy of the parameters, not
    one per step)."""
    return StepStarts(steps, initial)


class StepFiles(Sequence[RunTensors]):
    """A role directory's steps, read when indexed (the two read last kept): freeze walks the steps in order, so a
    run's evidence is held a step or two at a time, not K steps of gradients, updates and moments at once."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._n = num_steps(self.directory)
        self._kept: dict[int, RunTensors] = {}  # the two steps read last (a step and the one its start needs)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self._n))]
        if not -self._n <= k < self._n:
            raise IndexError(k)
        k %= self._n
        if k not in self._kept:
            if len(self._kept) >= 2:
                del self._kept[next(iter(self._kept))]
            self._kept[k] = load_run(self.directory, k)
        return self._kept[k]


class StepStarts(Sequence[dict]):
    """params_before_steps: step k's start, advanced from the latest one (or from the initial parameters when an
    earlier step is asked for)."""

    def __init__(self, steps: Sequence[RunTensors], initial: dict[str, torch.Tensor]) -> None:
        self.steps, self.initial = steps, initial
        self._at: tuple[int, dict[str, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if not 0 <= k < len(self):
            raise IndexError(k)
        if self._at is None or self._at[0] > k:
            self._at = (0, {n: t.double() for n, t in self.initial.items()})
        i, current = self._at
        while i < k:
            current, i = next_params(current, self.steps[i]), i + 1
        self._at = (k, current)
        return current


def structure_problems(candidate: RunTensors, reference: RunTensors) -> list[tuple[str, str]]:
    """(key, problem) for every missing or extra tensor and every shape or dtype mismatch."""
    problems = []
    # a lean reference keeps no updates or moments: a case's are judged by its own replay and derivations
    for group in LEAN_GROUPS if is_lean(reference.meta) else GROUPS:
        c, r = getattr(candidate, group), getattr(reference, group)
        for name in sorted(set(r) - set(c)):
            problems.append((f"{group}/{name}", "missing in candidate"))
        for name in sorted(set(c) - set(r)):
            problems.append((f"{group}/{name}", "not in reference"))
        for name in sorted(set(c) & set(r)):
            (cs, cd), (rs, rd) = tensor_spec(c, name), tensor_spec(r, name)
            if cs != rs:
                problems.append((f"{group}/{name}", f"shape {cs} != {rs}"))
            elif cd != rd:
                problems.append((f"{group}/{name}", f"dtype {cd} != {rd}"))
    return problems


def pair_metrics(candidate: RunTensors, reference: RunTensors) -> dict[str, dict[str, float]]:
    """metric values per tensor key, for the tensors both runs hold with equal shapes.

    Updates and moments are not compared with the reference's. AdamW's update is a function of the start parameters
    and the moments, whose conditioning is unbounded (an element whose first moment is near zero, or near eps against
    its second, turns a moment error within bound into any update), so a bound calibrated on a few controls cannot
    judge it. The moments are a function of the run's own gradients (which are compared), its clip coefficient and
    its previous moments; compared with the reference's, the second moment's error is the gradient's times the
    gradient (2 (1 - b2) g dg), a maximum over the few largest gradients that the controls sample poorly (correct
    bf16 TP2 cases' moments sat closer to their bounds than their gradients: benchmarks/LOG.md, "Moments by
    derivation"). What is judged instead: the
    update against what AdamW makes of the run's own moments and start (replay_metrics), and both by derivation
    from the case's own values (qualify.judge.derived). The clip fractions (DERIVED_OUTPUTS) likewise.
    """
    out: dict[str, dict[str, float]] = {}
    device = metrics.metrics_device()
    for group in GROUPS:
        if group in ("updates", "moments"):
            continue
        c, r = getattr(candidate, group), getattr(reference, group)
        for name in sorted(set(c) & set(r)):
            if group == "outputs" and name in DERIVED_OUTPUTS:
                continue
            a, b = c[name], r[name]  # one tensor of each side read at a time
            if a.shape != b.shape or a.dtype != b.dtype:
                continue  # a structure problem (structure_problems), not measured
            names = ("max_abs",)
            if group == "grads":
                names += ("rel_l2",)
            if group in DISTRIBUTION_GROUPS and a.numel() > 1:
                # the error's distribution: a shift of every element under one noisy outlier's max_abs still fails
                names += ("mean_abs", "p99_abs")
            out[f"{group}/{name}"] = metrics.pair_values(a, b, names, device)
    return out


def replay_metrics(run: RunTensors, params_before: dict[str, torch.Tensor], optimizer: Any,
                   adam_step: int = 1) -> dict[str, dict[str, float]]:
    """Per parameter: how far the run's update is from what AdamW's step adam_step makes of the run's own moments."""
    adamw = {"lr": optimizer.lr, "betas": tuple(optimizer.betas), "eps": optimizer.eps,
             "weight_decay": optimizer.weight_decay, "step": adam_step}
    out = {}
    for name, update in run.updates.items():
        m, v = run.moments.get(f"exp_avg/{name}"), run.moments.get(f"exp_avg_sq/{name}")
        if m is None or v is None or name not in params_before or update.shape != params_before[name].shape:
            out[f"updates/{name}"] = {"replay_max_abs": metrics.INF}
            continue
        out[f"updates/{name}"] = {"replay_max_abs": metrics.replay_max_abs(update, params_before[name], m, v, **adamw)}
    return out


def flips(candidate: RunTensors, reference: RunTensors) -> dict[str, float]:
    """Sign-flip fraction of each update (information, not judged)."""
    return {name: metrics.flip_frac(candidate.updates[name], reference.updates[name])
            for name in sorted(set(candidate.updates) & set(reference.updates))
            if candidate.updates[name].shape == reference.updates[name].shape}


def merge_max(into: dict[str, dict[str, float]], new: dict[str, dict[str, float]]) -> None:
    """Elementwise max of nested metric dicts, in place."""
    for key, ms in new.items():
        slot = into.setdefault(key, {})
        for metric, value in ms.items():
            slot[metric] = max(slot.get(metric, 0.0), value)
