"""Per-layer evidence and its frozen bounds: what `qualify diagnose` compares, measured the same way at freeze time.

Two kinds of per-layer tensors at step 1 (step0/ in the evidence), keyed like the per-tensor bounds:
- 'act/<module>': the forward output of every hooked module (qualify.models.hooks);
- 'grads/<group>': the FP32 gradients of one decoder layer ('model.layers.<i>': every 'model.layers.<i>.*'
  parameter together), of the embedding ('model.embed_tokens') or of the head ('head': final norm, LM or
  value head), the group taken as one vector;
each with freeze's metrics of multi-element tensors: max_abs, rel_l2, mean_abs and p99_abs.
Bounds follow the rule (qualify.bounds.rule.BoundRule): k x the largest control error of the family + the
floor (the kind's, or floor_ulps fp32 ulps of the tensor's magnitude) + under bf16 one rounding step, per
(key, metric), one file per role under acceptance/layers/, named by digest in the acceptance ('layer_bounds'). A reference scored before layer capture existed has
no layers.safetensors: freeze then writes no layer bounds and the acceptance is the same as before.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from qualify import metrics
from qualify.bounds.files import LAYER_BOUNDS_SCHEMA
from qualify.bounds.records import layer_record, read_record
from qualify.bounds.rule import FAMILIES, RULE, BoundRule, family_pairs, quantum
from qualify.runname import RunName
from qualify.store import dumps_json, read_tensors

LAYERS_FILE = "layers.safetensors"
"""Per-layer activations of a reference run's first step, in its role directory (covered by the acceptance)."""
ACTIVATION_KIND = "value"
"""Floor kind of an activation's max_abs: hidden states are O(1) numbers like the critic's values (the rule has
no floor of its own for them); rel_l2 takes the 'relative' floor, as per-tensor rel_l2 bounds do."""
_LAYER = re.compile(r"^model\.layers\.(\d+)(?:\.|$)")
HEAD = "head"
EMBED = "model.embed_tokens"


def layer_index(name: str) -> int | None:
    """Decoder layer of an activation or parameter name ('model.layers.3.mlp' -> 3), None outside the layers."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def grad_group(name: str) -> str:
    """The per-layer group of a parameter: 'model.layers.<i>', the embedding, or the head (final norm, LM/value head)."""
    i = layer_index(name)
    if i is not None:
        return f"model.layers.{i}"
    return EMBED if name.startswith(EMBED) else HEAD


def backward_groups(names: list[str]) -> list[str]:
    """Gradient groups in the order the backward computes them: head, last layer ... first layer, embedding."""
    groups = {grad_group(n) for n in names}
    layers = sorted((g for g in groups if layer_index(g) is not None), key=layer_index, reverse=True)
    return [g for g in (HEAD, *layers, EMBED) if g in groups]


def group_members(names: list[str]) -> dict[str, list[str]]:
    """group -> its parameter names (sorted)."""
    out: dict[str, list[str]] = {}
    for n in sorted(names):
        out.setdefault(grad_group(n), []).append(n)
    return out


def tensor_metrics(candidate: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """The per-tensor metrics of freeze's multi-element outputs and gradients (qualify.compare.pair_metrics):
    max_abs, rel_l2 and the error's distribution (mean_abs, p99_abs); +inf when the candidate is not finite."""
    return {"max_abs": metrics.max_abs(candidate, reference), "rel_l2": metrics.rel_l2(candidate, reference),
            "mean_abs": metrics.mean_abs(candidate, reference), "p99_abs": metrics.p99_abs(candidate, reference)}


def group_metrics(candidate: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                  names: list[str]) -> dict[str, float]:
    """tensor_metrics of a group of tensors taken as one vector (their flattened concatenation)."""
    flat_c = torch.cat([candidate[n].flatten() for n in names])
    flat_r = torch.cat([reference[n].flatten() for n in names])
    return tensor_metrics(flat_c, flat_r)


def layer_metrics(cand_acts: dict[str, torch.Tensor] | None, ref_acts: dict[str, torch.Tensor],
                  cand_grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """metric values per layer key for what both sides hold with equal shapes ('act/<module>', 'grads/<group>').

    The same function makes the control errors at freeze time and measures a candidate in diagnose.
    """
    out: dict[str, dict[str, float]] = {}
    for name in sorted(set(cand_acts or {}) & set(ref_acts)):
        c, r = cand_acts[name], ref_acts[name]
        if c.shape == r.shape:
            out[f"act/{name}"] = tensor_metrics(c, r)
    common = [n for n in set(cand_grads) & set(ref_grads) if cand_grads[n].shape == ref_grads[n].shape]
    for group, names in group_members(common).items():
        if len(names) == len(group_members(list(ref_grads)).get(group, [])):  # a group is judged whole or not at all
            out[f"grads/{group}"] = group_metrics(cand_grads, ref_grads, names)
    return out


def kind_of(key: str, metric: str) -> str:
    """Floor kind of a layer bound (the matrix's floors; see ACTIVATION_KIND)."""
    if metric == "rel_l2":
        return "relative"
    return ACTIVATION_KIND if key.startswith("act/") else "grad"


def magnitudes(acts: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """max |x| of every layer key of a reference run (for the rounding step of the rule)."""
    out = {f"act/{n}": float(t.double().abs().max()) if t.numel() else 0.0 for n, t in acts.items()}
    for group, names in group_members(list(grads)).items():
        out[f"grads/{group}"] = max((float(grads[n].double().abs().max()) for n in names if grads[n].numel()),
                                    default=0.0)
    return out


def run_layers(role_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(activations, step-0 gradients) of a reference run's role directory."""
    from qualify.compare import step_dir

    return read_tensors(Path(role_dir) / LAYERS_FILE), read_tensors(Path(role_dir) / step_dir(0) / "grads.safetensors")


def family_layer_bounds(layout: Any, role: str, family: str, controls: list[str], k: float, floors: dict[str, float],
                        use_quantum: bool, floor_ulps: float = 0.0) -> dict[str, Any]:
    """Layer bounds of one family for one role: the family's control runs against its reference run."""
    base_name, others = family_pairs(family, controls)
    base_acts, base_grads = run_layers(layout.scores(*RunName.parse(base_name), role))
    errors: dict[str, dict[str, float]] = {}
    for name in others:
        recorded = layer_record(read_record(layout.scores(*RunName.parse(name), role)), family)
        if recorded is None:  # kept in full: measured here
            acts, grads = run_layers(layout.scores(*RunName.parse(name), role))
            recorded = layer_metrics(acts, base_acts, grads, base_grads)
        for key, ms in recorded.items():
            slot = errors.setdefault(key, {})
            for metric, value in ms.items():
                slot[metric] = max(slot.get(metric, 0.0), value)
    rule = BoundRule(k, floors, floor_ulps, "fp32" if family == "fp32-repeat" else "bf16", use_quantum)
    mags = magnitudes(base_acts, base_grads)
    # hidden states and gradients are both computed in the compute precision: under bf16 one rounding step of it
    # at the tensor's magnitude is theirs to spend, as freeze grants the per-tensor gradients
    bf16 = rule.precision != "fp32" and use_quantum
    bounds = {key: {m: rule.entry(key, m, v, mags[key], kind_of(key, m),
                                  quantum(rule.precision, m, mags[key]) if bf16 else 0.0)
                    for m, v in ms.items()} for key, ms in errors.items()}
    return {"reference_run": base_name, "control_runs": others, "bounds": bounds}


def has_layers(layout: Any, controls: list[str], precisions: list[str], roles: tuple[str, ...]) -> bool:
    """Every scored run of the reference (each of the matrix's roles) holds its layer activations, or (a control kept
    as a summary) their metrics against each of its families' r0."""
    def held(role_dir: Path) -> bool:
        if (role_dir / LAYERS_FILE).is_file():
            return True
        record = read_record(role_dir)
        return record is not None and all("layers" in f for f in record["families"].values())
    return all(held(layout.scores(p, c, role)) for p in precisions for c in controls for role in roles)


def layer_bound_files(layout: Any, rule: Any, precisions: tuple[str, ...], roles: tuple[str, ...],
                      controls: list[str]) -> dict[str, bytes]:
    """{'<role>.json': canonical JSON} of the layer bounds of every role the matrix scores; empty when the reference
    has no layer activations."""
    if not has_layers(layout, controls, list(precisions), tuple(roles)):
        return {}
    files = {}
    k, floors, floor_ulps = rule.k, dict(rule.floors), rule.floor_ulps
    for role in roles:  # GRPO: the actor alone (no critic is scored)
        doc = {"schema": LAYER_BOUNDS_SCHEMA, "role": role, "step": 0, "k": k, "floors": floors,
               "floor_ulps": floor_ulps, "rule": RULE,
               "families": {f: family_layer_bounds(layout, role, f, controls, k, floors, rule.quantum,
                                                   floor_ulps) for f in FAMILIES}}
        files[f"{role}.json"] = dumps_json(doc).encode("ascii")
    return files
