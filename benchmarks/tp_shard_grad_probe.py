"""Does a vocabulary shard's weight gradient depend on the layout of its output gradient? (the bf16 TP2
lm_head gradient margin on the Intel host).

A TP rank's column-parallel lm_head computes its shard's weight gradient from a contiguous (tokens, V/tp) output
gradient; the tp_split control (qualify.reference.tp_numerics.column_parallel_linear) concatenates the shards'
outputs, so autograd hands each shard a strided view of the full output gradient. Same values, same GEMM shape:
whether the kernel the CPU picks for the strided operand accumulates in another order is what this measures, side by
side in one run, for bf16 and fp32, at the embedded default's lm_head shape and a wider one.

Prints, per dtype and shape, how many weight-gradient elements differ bitwise between the two layouts (and the
full-vocabulary GEMM sliced per shard), and the largest |difference| relative to the gradient's largest element.
Usage: python benchmarks/tp_shard_grad_probe.py [--tp 2] [--tokens 320] [--threads N]
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch
import torch.nn.functional as F


def shard_grads(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, tp: int, contiguous: bool) -> torch.Tensor:
    """The weight gradient of y = concat over shards of x @ W[shard]^T, each shard's from its slice of dy (a strided
    view of dy, or a contiguous copy of it as a TP rank holds it)."""
    width = weight.shape[0] // tp
    w = weight.detach().requires_grad_(True)
    parts = [F.linear(x, w[r * width:(r + 1) * width]) for r in range(tp)]
    if contiguous:
        for r, part in enumerate(parts):
            part.backward(dy[:, r * width:(r + 1) * width].contiguous())
    else:
        torch.cat(parts, dim=-1).backward(dy)
    return w.grad


def compare(a: torch.Tensor, b: torch.Tensor) -> str:
    differ = int((a != b).sum())
    rel = float((a.float() - b.float()).abs().max() / a.float().abs().max().clamp(min=1e-30))
    return f"{differ:6d} of {a.numel()} differ, max |diff| / max |grad| {rel:.3g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=320)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor())
    print(f"{cpu}; torch {torch.__version__}; {torch.get_num_threads()} threads; "
          f"mkldnn bf16 {torch.backends.mkldnn.is_available()}")
    g = torch.Generator().manual_seed(0)
    for vocab, hidden in ((512, 64), (4096, 1024)):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(args.tokens, hidden, generator=g).to(dtype)
            weight = (0.1 * torch.randn(vocab, hidden, generator=g)).to(dtype)
            dy = (torch.randn(args.tokens, vocab, generator=g) / args.tokens).to(dtype)
            strided = shard_grads(x, weight, dy, args.tp, contiguous=False)
            rank = shard_grads(x, weight, dy, args.tp, contiguous=True)
            full = dy.t() @ x
            name = str(dtype).removeprefix("torch.")
            print(f"V={vocab} H={hidden} {name:8s} strided vs contiguous shard: {compare(rank, strided)}")
            print(f"V={vocab} H={hidden} {name:8s} full GEMM vs contiguous shard: {compare(rank, full)}")


if __name__ == "__main__":
    main()
