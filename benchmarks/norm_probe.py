"""Where a clip norm drifts: torch's fp32 vector_norm on the CPU and on a GPU, and the torch-tp engine's norm
(qualify.engines.torch_tp.grad_norm), against float64, side by side on the same tensors, each as a ratio to the
allowance the derived check gives any engine (qualify.judge.derived: 2^-24 x (2 log2 n + 8) x norm; a ratio
above 1 fails the row).

Usage: python benchmarks/norm_probe.py   (CUDA columns when a GPU is there)
"""

from __future__ import annotations

import math

import torch

from qualify.engines.torch_tp import grad_norm

U = 2.0 ** -24


def tensors() -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    embed = torch.zeros(151936, 1024)
    rows = torch.randint(0, embed.shape[0], (4000,), generator=g)
    embed[rows] = torch.randn(len(rows), 1024, generator=g) * 1e-2
    return {"Qwen3 embedding-shaped, 4000 rows set": [embed],
            "dense N(0,1), 16M": [torch.randn(16_000_000, generator=g)],
            "dense N(0,1), 155M": [torch.randn(155_000_000, generator=g)]}


def norm_of_norms(grads: list[torch.Tensor]) -> float:
    """What the torch-tp engine did before: each tensor's fp32 vector_norm where it is, then the norm of those."""
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t).cpu() for t in grads])))


def main() -> None:
    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__}; GPU: {torch.cuda.get_device_name() if cuda else 'none'}")
    print("tensor | exact | CPU fp32 vector_norm (rel err, x allowance) | "
          + ("CUDA fp32 vector_norm | " if cuda else "") + "grad_norm on CPU" + (" | grad_norm on CUDA" if cuda else ""))
    for name, grads in tensors().items():
        exact = math.sqrt(sum(float(torch.linalg.vector_norm(t.double())) ** 2 for t in grads))
        n = sum(t.numel() for t in grads)
        allow = U * (2 * math.log2(n) + 8) * exact
        cols = [norm_of_norms(grads)]
        if cuda:
            on_gpu = [t.cuda() for t in grads]
            cols.append(norm_of_norms(on_gpu))
        cols.append(float(grad_norm(grads)))
        if cuda:
            cols.append(float(grad_norm(on_gpu)))
        print(f"{name} | {exact:.9g} | " + " | ".join(f"{abs(c - exact) / exact:.2e} ({abs(c - exact) / allow:.3g}x)"
                                                       for c in cols))


if __name__ == "__main__":
    main()
