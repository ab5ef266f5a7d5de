"""Per-layer activations of a Hugging Face Qwen3 forward, captured with generic torch forward hooks.

The reference (every control of `qualify reference`) and the HF-based engines (torch-tp, deepspeed) use
the same capture, so a name means the same module output everywhere: for each decoder layer i, in
forward order, 'model.layers.<i>.input_layernorm', '.self_attn' (after o_proj), '.post_attention_layernorm',
'.mlp' (after down_proj) and 'model.layers.<i>' itself (the residual stream after the layer), then
'model.norm' (the final norm). No model code is edited: hooks are registered for one forward and removed.
The megatron engine hooks megatron-core's own modules under the same HF names (megatron_modules).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
"""Sub-modules of a decoder layer whose outputs are captured, in forward order (the layer's own output last)."""
FINAL_NORM = "model.norm"


def activation_names(num_layers: int) -> list[str]:
    """Every captured activation of a model with num_layers decoder layers, in forward order."""
    names = []
    for i in range(num_layers):
        names += [f"model.layers.{i}.{part}" for part in PARTS] + [f"model.layers.{i}"]
    return names + [FINAL_NORM]


def hooked_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(activation name, module) of every captured module of an HF Qwen3 model (causal LM or token classifier)."""
    base = model.model  # Qwen3Model under both heads
    for i, layer in enumerate(base.layers):
        for part in PARTS:
            yield f"model.layers.{i}.{part}", getattr(layer, part)
        yield f"model.layers.{i}", layer
    yield FINAL_NORM, base.norm


def _first_tensor(output: object) -> torch.Tensor:
    """A module's hidden-state output: attention and some decoder layers return tuples, the states first."""
    while isinstance(output, tuple | list):
        output = output[0]
    assert isinstance(output, torch.Tensor), type(output)
    return output


def _full_fp32(t: torch.Tensor) -> torch.Tensor:
    """A detached full fp32 CPU copy (a DTensor output of a TP plan is gathered first)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to(torch.float32).cpu().clone()


MEGATRON_PARTS = {"input_layernorm": "input_layernorm", "self_attention": "self_attn",
                  "pre_mlp_layernorm": "post_attention_layernorm", "mlp": "mlp"}
"""megatron-core TransformerLayer sub-module -> the HF module computing the same tensor."""


def megatron_modules(gpt: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(HF activation name, module) of a megatron-core GPTModel (PP 1). A norm fused into the next linear
    (an IdentityOp in its place, as in the Transformer Engine spec) is left out: its output is not the norm's."""
    for i, layer in enumerate(gpt.decoder.layers):
        for part, hf in MEGATRON_PARTS.items():
            module = getattr(layer, part, None)
            if module is not None and "Identity" not in type(module).__name__:
                yield f"model.layers.{i}.{hf}", module
        yield f"model.layers.{i}", layer
    yield FINAL_NORM, gpt.decoder.final_layernorm


@torch.no_grad()
def capture_outputs(modules: Iterator[tuple[str, torch.nn.Module]], forward: Callable[[], object],
                    seq_first: bool = False) -> dict[str, torch.Tensor]:
    """Full fp32 CPU output of every named module during forward(), batch-first (B, T, H).

    forward may run several micro-batches: each module's outputs are concatenated along the batch in call
    order. seq_first: the modules return (T, B, H), as megatron-core's do.
    """
    parts: dict[str, list[torch.Tensor]] = {}

    def hook_for(name: str):
        def hook(module, args, output):
            t = _full_fp32(_first_tensor(output))
            parts.setdefault(name, []).append(t.transpose(0, 1) if seq_first else t)
        return hook

    handles = [module.register_forward_hook(hook_for(name)) for name, module in modules]
    try:
        forward()
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(chunks).contiguous() for name, chunks in parts.items()}


def capture_layer_outputs(model: torch.nn.Module, input_ids_BT: torch.Tensor, microbatches: int = 1,
                          reverse_rows: bool = False, routes_BTLK: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """(B, T, H) fp32 output of every hooked module of an HF model for input_ids_BT (rows in their given order).

    microbatches and reverse_rows run the forward the way a reference control runs it (row split,
    reversed row order); the captured rows are put back in input order, so every control's tensors
    line up with r0's row for row. routes_BTLK: a MoE model's replayed routes of those rows (qualify.models.routing).
    """
    from qualify.models.routing import routing

    order = torch.arange(input_ids_BT.shape[0])
    if reverse_rows:
        order = order.flip(0)
    ids_BT = input_ids_BT[order].to(next(model.parameters()).device)
    routes = None if routes_BTLK is None else routes_BTLK[order]
    step = -(-ids_BT.shape[0] // microbatches)

    def forward() -> None:
        for start in range(0, ids_BT.shape[0], step):
            with routing(model, None if routes is None else routes[start:start + step]):
                model(input_ids=ids_BT[start:start + step], use_cache=False)

    out = capture_outputs(hooked_modules(model), forward)
    undo = torch.argsort(order)
    return {name: t[undo].contiguous() for name, t in out.items()}
