"""Where an exact claim breaks: a declared rollout_exact actor's step-0 layers against the rollout engine's own.

When the rollout carries vLLM's per-layer activations (rollout.layer_outputs, qualify.rollout.layers), a case whose
engine declares rollout_exact runs its layer_outputs hook on the step-0 batch before the step, with no gradient, and
counts per layer the response tokens whose vector is not bitwise vLLM's (an engine whose score() runs another
forward than its layer_outputs hook, kept for qualify diagnose, gives that forward's by exact_layer_outputs). A token's vector is the activation at the
position that predicts it (position t - 1 for the token at t): the one its logprob is computed from. The counts go in
meta.json ('rollout_layers') and the exact row's note names the first layer that differs
(qualify.judge.rollout_exact); they judge nothing: the tier is the logprob count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qualify.errors import EvidenceError
from qualify.rollout.layers import LAYERS_FILE
from qualify.rollout.meta import NAME as ROLLOUT_META
from qualify.rollout.meta import read_rollout_meta

NOT_CAPTURED = "not captured (the rollout has no layer outputs: rollout.layer_outputs is off)"
NO_HOOK = "not compared (the engine has no layer_outputs hook)"


def scoring_mask(response_mask_BT: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the positions whose activations predict a response token (t - 1 for a response token at t)."""
    mask = response_mask_BT.bool()
    return torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)


def compare_layers(own: dict[str, torch.Tensor], rollout: dict[str, torch.Tensor], names: list[str],
                   mask_BT: torch.Tensor) -> list[dict[str, Any]]:
    """Per name, in the given (forward) order: the masked positions compared and how many of them hold a (B, T, H)
    vector not bitwise the rollout's (a name the engine does not give counts every position as differing)."""
    out = []
    for name in names:
        ref = rollout[name].float()
        mine = own.get(name)
        if mine is None or tuple(mine.shape) != tuple(ref.shape):
            differs = mask_BT
        else:
            differs = (mine.float() != ref).any(dim=-1) & mask_BT
        out.append({"name": name, "num_tokens": int(mask_BT.sum()), "num_not_bitwise": int(differs.sum()),
                    **({"missing": True} if mine is None else {})})
    return out


@torch.no_grad()
def probe_rollout_layers(engine: Any, batch: Any, rollout_dir: Path, rows: slice) -> dict[str, Any]:
    """The engine's step-0 layers (its exact_layer_outputs hook on batch, the rollout's rows, else its layer_outputs)
    against the rollout's; a 'skipped' reason where the rollout has no layers or the engine no hook."""
    from qualify.store import read_tensors

    path = Path(rollout_dir) / LAYERS_FILE
    if not path.is_file():
        return {"skipped": NOT_CAPTURED}
    # an engine whose score() is not the forward its layer_outputs (diagnose's HF hooks) runs says so by this one
    hook = getattr(engine, "exact_layer_outputs", None) or getattr(engine, "layer_outputs", None)
    if hook is None:
        return {"skipped": NO_HOOK}
    record = read_rollout_meta(rollout_dir)
    if record.layer_names is None or record.layer_rows is None:
        raise EvidenceError(f"{rollout_dir}/{ROLLOUT_META}: no layer_outputs record beside its {LAYERS_FILE}")
    every = read_tensors(path)
    fed = torch.zeros(every[record.layer_names[0]].shape[0], dtype=torch.bool)
    fed[record.layer_rows] = True  # rows too long for vLLM's prefill pass hold no activations
    rollout = {name: t[rows] for name, t in every.items()}
    mask_BT = scoring_mask(batch.response_mask_BT.cpu()) & fed[rows][:, None]
    own = {name: t.cpu() for name, t in hook(batch).items() if name in rollout}
    return {"layers": compare_layers(own, rollout, record.layer_names, mask_BT)}


def merge_ranks(by_rank: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Every DP rank's probe of its own rows, summed per layer (a rank's skip reason stands for all: they share the
    rollout and the engine)."""
    found = [p for p in by_rank if p]
    if not found or "skipped" in found[0]:
        return found[0] if found else None
    out = [dict(entry) for entry in found[0]["layers"]]
    for probe in found[1:]:
        for slot, entry in zip(out, probe["layers"], strict=True):
            slot["num_tokens"] += entry["num_tokens"]
            slot["num_not_bitwise"] += entry["num_not_bitwise"]
    return {"layers": out}


def layers_note(record: dict[str, Any] | None, declared: bool) -> str:
    """The exact row's phrase on the layers: the first that differs and how many tokens, the final norm's count;
    '' for an undeclared case (never probed)."""
    if not declared:
        return ""
    if not record:
        return "; layers: not compared (the case's evidence holds no layer probe)"
    if "skipped" in record:
        return f"; layers: {record['skipped']}"
    layers = record["layers"]
    first = next((i for i, entry in enumerate(layers) if entry["num_not_bitwise"]), None)
    n = layers[0]["num_tokens"]
    if first is None:
        return (f"; layers against the rollout engine's prefill: all {len(layers)} bitwise ({layers[0]['name']} to "
                f"{layers[-1]['name']}, {n} tokens)")
    head = "" if first == 0 else (f"{layers[0]['name']}{'' if first == 1 else ' to ' + layers[first - 1]['name']} "
                                  "bitwise, ")
    worst, last = layers[first], layers[-1]
    tail = "" if last is worst else f", {last['name']} {last['num_not_bitwise']} of {n}"
    return (f"; layers against the rollout engine's prefill: {head}first differing {worst['name']} "
            f"({worst['num_not_bitwise']} of {n} tokens){tail}")
