"""Read the tensors of a local HF checkpoint directory (every *.safetensors file, HF names)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from qualify.errors import EvidenceError


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """name -> tensor over all safetensors shards; duplicate names are an error."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise EvidenceError(f"no *.safetensors in {model_dir}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:  # a checkpoint is plain safetensors (never qualify's coded evidence): read here, not through qualify.store
            tensors = load_file(str(f))
        except SafetensorError as exc:
            raise EvidenceError(f"{f}: not a readable safetensors file: {exc}") from exc
        for name, tensor in tensors.items():
            if name in out:
                raise EvidenceError(f"{model_dir}: tensor {name} appears in more than one shard")
            out[name] = tensor
    return out


_EXPERT = re.compile(r"(?P<prefix>.+\.mlp\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")


def initial_parameters(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the names and in the layout of the loaded model's parameters (what every stage's
    evidence names): a Qwen3-MoE checkpoint stores each expert's gate_proj, up_proj and down_proj on its own, which
    transformers loads as one gate_up_proj (E, 2 x I, H: gate rows, then up rows) and one down_proj (E, H, I) per
    layer; a dense checkpoint's tensors are its parameters as they are."""
    tensors = checkpoint_tensors(model_dir)
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            out[name] = tensor
        else:
            experts.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["index"])] = tensor
    for prefix, projs in experts.items():
        count = len(projs.get("gate_proj", {}))
        if any(sorted(projs.get(p, {})) != list(range(count)) for p in ("gate_proj", "up_proj", "down_proj")):
            raise EvidenceError(f"{model_dir}: {prefix} does not hold gate_proj, up_proj and down_proj of experts "
                                f"0..{count - 1}")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], 0)
                                                     for e in range(count)])
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(count)])
    return out


_FUSED = re.compile(r"(?P<prefix>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)")


def checkpoint_layout(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """initial_parameters' inverse: tensors named and laid out as the model's parameters (a Qwen3-MoE layer's fused
    gate_up_proj and down_proj) under the checkpoint's names, each expert's projections on their own (slices, exact)."""
    out = {}
    for name, tensor in params.items():
        m = _FUSED.fullmatch(name)
        if m is None:
            out[name] = tensor
        elif m["proj"] == "down_proj":
            out.update({f"{m['prefix']}.{e}.down_proj.weight": t for e, t in enumerate(tensor)})
        else:
            width = tensor.shape[1] // 2
            for e, t in enumerate(tensor):
                out[f"{m['prefix']}.{e}.gate_proj.weight"] = t[:width]
                out[f"{m['prefix']}.{e}.up_proj.weight"] = t[width:]
    return out


def quiet_transformers() -> None:
    """No per-load progress bars from transformers (stage progress is qualify's own)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
