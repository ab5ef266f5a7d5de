"""A single-process control with the reduction orders a tensor-parallel engine legitimately has.

A TP engine computes the same model, but some sums are split across ranks and added in another order:
a row-parallel linear (attention o_proj, MLP down_proj) multiplies each rank's slice of the input features
by its slice of the weight and all-reduces the partial outputs, each already rounded to the compute
precision; a column-parallel linear (q/k/v, gate/up, and the vocabulary projection) is exact per output in
the forward, but its input gradient is the sum of the ranks' partial products. The repeats, micro-batch
split and attention-implementation controls never sample these orders, so a correct TP engine's bf16
error could sit outside what bounds calibrated on them allow.

`split_like_tp(model, tp)` makes the reference model compute exactly that way, in one process: the same
weights (no copy), every row-parallel linear as tp partial matmuls in the module's dtype added in rank
order, every column-parallel linear as tp slices concatenated (autograd then sums the input gradient's tp
partial products). Nothing else changes, so the control differs from r0 only by reduction order.

Two other kernels engines legitimately use are here too: `fuse_projections` (q/k/v and gate/up as one GEMM each,
as Megatron computes them) and `fuse_norms` (each RMSNorm as one fused kernel, torch's F.rms_norm, rounding once
where Hugging Face's module rounds the normalized input before multiplying by the weight: what Megatron's
torch-norm fallback, apex and Transformer Engine compute).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qualify.errors import EngineError

ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
VOCAB_PARALLEL = ("lm_head",)


def shard_bounds(size: int, tp: int, padded: bool = False) -> list[tuple[int, int]]:
    """[start, end) of each rank's contiguous slice of a dimension of size `size`: tp must divide it, unless padded
    (a vocabulary a TP engine pads to a multiple of tp: each rank holds ceil(size / tp) rows, the last fewer real
    ones)."""
    if tp < 1 or (size % tp and not padded):
        raise ValueError(f"tp={tp} does not divide a dimension of size {size}")
    width = -(-size // tp)
    return [(min(r * width, size), min((r + 1) * width, size)) for r in range(tp)]


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: int) -> torch.Tensor:
    """y = sum over ranks r of x[..., in_r] @ W[:, in_r]^T, each partial in x's dtype, added in rank order."""
    y = None
    for a, b in shard_bounds(weight.shape[1], tp):
        part = F.linear(x[..., a:b], weight[:, a:b])
        y = part if y is None else y + part
    return y if bias is None else y + bias


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: int) -> torch.Tensor:
    """y = concat over ranks r of x @ W[out_r]^T (+ b[out_r]): exact per output; the input gradient is the sum
    of the tp partial products (autograd adds the slices' contributions)."""
    parts = [F.linear(x, weight[a:b], None if bias is None else bias[a:b])
             for a, b in shard_bounds(weight.shape[0], tp, padded=True) if b > a]
    return torch.cat(parts, dim=-1)


def _split(linear: torch.nn.Linear, fn, tp: int) -> None:
    # the instance's forward is replaced; the parameters stay the module's own (optimizer and hooks unchanged)
    def forward(x: torch.Tensor) -> torch.Tensor:
        return fn(x, linear.weight, linear.bias, tp)

    linear.forward = forward


def split_like_tp(model: torch.nn.Module, tp: int) -> int:
    """Make model's linears compute with TP degree tp's reduction orders (see the module docstring); returns how
    many linears were split. tp = 1 leaves the model as it is."""
    if tp == 1:
        return 0
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if name.endswith(ROW_PARALLEL):
            _split(module, row_parallel_linear, tp)
        elif name.endswith(COLUMN_PARALLEL) or name in VOCAB_PARALLEL:
            _split(module, column_parallel_linear, tp)
        else:
            continue
        count += 1
    if count == 0:
        raise EngineError("tp_split: no tensor-parallel linear found (the model is not a Qwen3-style decoder)")
    return count


FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def _fuse(members: list[torch.nn.Linear]) -> None:
    """The first member's call computes one GEMM with the members' weights concatenated and hands the others their
    slices of it when they are called with the same input (what Megatron's fused QKV and gate/up projections do):
    the forward is exact per output, and the input gradient is one GEMM over the summed output gradient instead of
    the members' separately rounded partial products added by autograd."""
    state: dict[str, object] = {}
    widths = [m.weight.shape[0] for m in members]

    def lead(x: torch.Tensor) -> torch.Tensor:
        weight = torch.cat([m.weight for m in members], dim=0)
        bias = None if members[0].bias is None else torch.cat([m.bias for m in members], dim=0)
        parts = F.linear(x, weight, bias).split(widths, dim=-1)
        state["x"], state["parts"] = x, parts
        return parts[0]

    def follower(i: int, module: torch.nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if state.get("x") is not x:  # called on another input: compute alone (the fusion's premise is broken)
                return F.linear(x, module.weight, module.bias)
            return state["parts"][i]  # type: ignore[index]
        return forward

    members[0].forward = lead
    for i, m in enumerate(members[1:], start=1):
        m.forward = follower(i, m)


def fuse_projections(model: torch.nn.Module) -> int:
    """Make each layer's q/k/v and gate/up projections compute as one fused GEMM (see _fuse); returns how many
    groups were fused."""
    modules = dict(model.named_modules())
    count = 0
    for name in modules:
        for group in FUSED_GROUPS:
            if not name.endswith("." + group[0]) and name != group[0]:
                continue
            prefix = name[: len(name) - len(group[0])]
            members = [modules.get(prefix + g) for g in group]
            if all(isinstance(m, torch.nn.Linear) for m in members):
                _fuse(members)  # type: ignore[arg-type]
                count += 1
    if count == 0:
        raise EngineError("fused_projections: no q/k/v or gate/up projections found (not a Qwen3-style decoder)")
    return count


def _fused_norm_forward(norm: torch.nn.Module):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (norm.weight.shape[-1],), norm.weight, norm.variance_epsilon)
    return forward


def fuse_norms(model: torch.nn.Module) -> int:
    """Make each Hugging Face RMSNorm (a module with `weight` and `variance_epsilon`, computing
    weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)) compute as torch's fused F.rms_norm: the same function, one
    rounding of the product in the compute dtype instead of two, and the fused kernel's own reduction orders in the
    backward. The parameters stay the module's own. Returns how many norms were replaced."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.nn.Parameter)
                and weight.dim() == 1 and isinstance(getattr(module, "variance_epsilon", None), float)):
            module.forward = _fused_norm_forward(module)
            count += 1
    if count == 0:
        raise EngineError("fused_norm: no RMSNorm with weight and variance_epsilon found (not a Qwen3-style decoder)")
    return count
