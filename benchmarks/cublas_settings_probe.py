"""Do cuBLAS's settings decide whether a bf16 GEMM's rows depend on the row count, and which of them, and when must
they be in place? (seed 002's review names "cuBLAS workspace and TF32 settings installed after the first
matmul" as a way an exactness claim breaks.)

Each setting runs in a fresh process, so cuBLAS starts under it. vLLM's batch-invariant settings
(qualify.examples.vllm_gpu_exact.install_invariant_settings) are four: a 16 KiB cuBLAS workspace and a 1 KiB cuBLASLt
one (environment variables torch reads once), cuBLASLt preferred and no reduced-precision bf16 reductions (read at each
GEMM). Settings: 'none' (torch's defaults); 'flag', 'lt', 'env' (one of them alone, before any GEMM); 'before' (all,
before the first GEMM); 'after' (one GEMM through cuBLAS first, then all); 'after-lt' (cuBLASLt preferred and one GEMM
through it first, so that it starts with its default workspace, then all). For each linear of the Qwen3-0.6B widths
(K x N), X is R rows of T tokens: the GEMM over every row at once is compared bit for bit, row for row, with the same
rows in micro-batches of 1 and 4 sequences, and with a decode step's GEMM (one token of each sequence, M = R).

    python benchmarks/cublas_settings_probe.py [SETTING ...]      (default: every setting; 8 x 40 and 128 x 64)
"""

from __future__ import annotations

import json
import subprocess
import sys

SHAPES = {"qkv_proj": (1024, 4096), "o_proj": (2048, 1024), "gate_up_proj": (1024, 6144), "down_proj": (3072, 1024),
          "lm_head": (1024, 151936)}
"""Qwen3-0.6B's linears as vLLM runs them (merged q/k/v and gate/up): (in features K, out features N)."""


SETTINGS = ("none", "flag", "lt", "env", "before", "after", "after-lt")
SIZES = ((8, 40), (128, 64))
"""(sequences R, tokens T) of each comparison."""


def first_gemm() -> None:
    import torch

    a = torch.ones(256, 256, dtype=torch.bfloat16, device="cuda")
    (a @ a).sum().item()


def apply(setting: str) -> None:
    """Put the setting in place in this process (see the module docstring)."""
    import os

    import torch

    from qualify.examples.vllm_gpu_exact import INVARIANT_ENV, install_invariant_settings

    if setting == "flag":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    elif setting == "lt":
        torch.backends.cuda.preferred_blas_library(backend="cublaslt")
    elif setting == "env":
        os.environ.update(INVARIANT_ENV)
    elif setting == "before":
        install_invariant_settings()
    elif setting == "after":
        first_gemm()
        install_invariant_settings()
    elif setting == "after-lt":
        torch.backends.cuda.preferred_blas_library(backend="cublaslt")
        first_gemm()
        install_invariant_settings()
    elif setting != "none":
        raise SystemExit(f"unknown setting {setting!r}; one of {SETTINGS}")


def one(setting: str) -> dict:
    import torch
    import torch.nn.functional as F

    apply(setting)
    out = {}
    for rows, tokens in SIZES:
        g = torch.Generator("cuda").manual_seed(0)
        for name, (k, n) in SHAPES.items():
            w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
            x = torch.randn(rows * tokens, k, device="cuda", generator=g).to(torch.bfloat16)
            whole = F.linear(x, w)
            counts = {}
            for mb in (1, 4):
                step = mb * tokens
                parts = torch.cat([F.linear(x[i:i + step], w) for i in range(0, x.shape[0], step)])
                counts[f"micro-batch {mb}"] = f"{int((parts != whole).any(-1).sum())}/{rows * tokens}"
            decode = x.view(rows, tokens, k)[:, -1]  # one token of each sequence, as a decode step computes it
            differ = (F.linear(decode, w) != whole.view(rows, tokens, n)[:, -1]).any(-1).sum()
            counts["decode step"] = f"{int(differ)}/{rows}"
            out[f"{rows}x{tokens} {name}"] = counts
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2])))
        return
    print("token rows whose output is not bitwise the whole batch's (decode: of the sequences)")
    for setting in sys.argv[1:] or SETTINGS:
        done = subprocess.run([sys.executable, __file__, "--one", setting],
                              check=False, capture_output=True, text=True)
        if done.returncode:
            print(f"{setting}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
            continue
        for name, counts in json.loads(done.stdout.strip().splitlines()[-1]).items():
            print(f"{setting:>8} {name:>22}: " + ", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)


if __name__ == "__main__":
    main()
