"""A rollout's per-layer activations: every decoder layer's residual stream and the final norm, as vLLM's prefill of
each sampled sequence computed them (rollout.layer_outputs).

Where an engine claims the rollout's logprobs bit for bit (seed 002) and misses, these say in which layer its forward
first parts from vLLM's. vLLM's decoder layer does not return the residual stream: it returns (hidden_states, residual)
with the residual add fused into the next layer's input norm (vllm/model_executor/models/qwen3.py: the output is the
MLP's output and the residual before the MLP; vllm.ir.ops.fused_add_rms_norm adds them in fp32 and casts to the model's
dtype). The residual stream after layer i in Hugging Face's terms, 'model.layers.<i>' of qualify.models.hooks, is that
sum, computed here as the next norm computes it; 'model.norm' is the final norm's output. bind() sets a forward hook on
every decoder layer and the final norm in each worker (llm.apply_model), each forward appends its rows, take() returns
and clears them. The hooks see a forward's rows without request ids, so the pass feeds one sequence at a time
(qualify.rollout.vllm_worker.prefill_layers): every row then belongs to it, in position order.

In the rollout directory, layers.safetensors holds one (B, T, H) float32 tensor per name (the values vLLM held, exact
in float32 for an fp32 or bf16 rollout), rows and positions as rollout.safetensors, 0 where no token was fed.
"""

from __future__ import annotations

from typing import Any

from qualify.errors import QualifyError

LAYERS_FILE = "layers.safetensors"
FINAL_NORM = "model.norm"
SOURCE = ("forward hooks on vLLM's decoder layers (hidden_states + residual, added in fp32 and cast to the model's "
          "dtype as the next norm adds them) and its final norm, bound in-process; each sampled sequence fed again "
          "as one prompt, one request at a time")
"""How the layers were recorded (rollout.json's layer_outputs.source)."""

_captured: dict[str, list[Any]] = {}
"""Per activation name, the (rows, H) tensors of each forward since the last take() (in a vLLM worker process)."""


def layer_names(num_layers: int) -> list[str]:
    """The recorded names of a model with num_layers decoder layers, in forward order."""
    return [f"model.layers.{i}" for i in range(num_layers)] + [FINAL_NORM]


def bind(model: Any) -> int:
    """Hook every decoder layer and the final norm of a worker's model; the number of decoder layers (run by
    apply_model)."""
    base = model.model
    for i, layer in enumerate(base.layers):
        layer.register_forward_hook(_residual_hook(f"model.layers.{i}"))
    base.norm.register_forward_hook(_norm_hook)
    _captured.clear()
    return len(base.layers)


def _residual_hook(name: str):
    import torch

    def hook(module: Any, args: Any, output: Any) -> None:
        hidden, residual = output  # the next norm adds them in place: the sum is taken now, before it runs
        summed = (hidden.to(torch.float32) + residual.to(torch.float32)).to(hidden.dtype)
        _captured.setdefault(name, []).append(summed.to("cpu", torch.float32))
    return hook


def _norm_hook(module: Any, args: Any, output: Any) -> None:
    import torch

    normed = output[0] if isinstance(output, tuple) else output  # (normed, residual) when called with a residual
    _captured.setdefault(FINAL_NORM, []).append(normed.detach().to("cpu", torch.float32).clone())


def take(model: Any) -> dict[str, Any]:
    """The activations captured in this worker since the last take(), one (rows, H) float32 tensor per name;
    cleared."""
    import torch

    out = {name: torch.cat(chunks, 0) for name, chunks in _captured.items()}
    _captured.clear()
    return out


def request_layers(per_rank: list[dict[str, Any]], names: list[str], rows: int, what: str) -> dict[str, Any]:
    """One sequence's activations from rank 0's take() (the capture runs at vLLM TP1): every name, exactly rows rows
    (the sequence's length: vLLM fed every token and read nothing from a cache)."""
    (found,) = per_rank
    if sorted(found) != sorted(names):
        raise QualifyError(f"{what}: vLLM's hooks captured {sorted(found)}, expected {names}")
    for name in names:
        if found[name].shape[0] != rows:
            raise QualifyError(f"{what}: {name} captured {found[name].shape[0]} rows, the sequence has {rows} tokens "
                               "(a cached prefix or a padded batch would leave rows out or add some)")
    return {name: found[name] for name in names}


def layers_tensors(per_row: dict[int, dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    """(B, T, H) float32 per name of right-padded rows (T the longest row), 0 where no sequence was fed; per_row
    maps a row index to its sequence's (rows, H) activations."""
    import torch

    first = next(iter(per_row.values()))
    B, T = len(lengths), max(lengths)
    out = {name: torch.zeros(B, T, t.shape[-1], dtype=torch.float32) for name, t in first.items()}
    for b, acts in per_row.items():
        for name, t in acts.items():
            out[name][b, :t.shape[0]] = t
    return out
