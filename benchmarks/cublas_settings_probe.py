"""Do cuBLAS's workspace settings decide whether a bf16 GEMM's rows depend on the row count? (issue 33: seed 002's
review names "cuBLAS workspace and TF32 settings installed after the first matmul" as a way an exactness claim breaks.)

Each setting runs in a fresh process, so cuBLAS starts under it: 'before' puts vLLM's batch-invariant settings
(qualify.examples.vllm_gpu_exact.install_invariant_settings: a 16 KiB cuBLAS and 1 KiB cuBLASLt workspace, cuBLASLt
preferred, no reduced-precision bf16 reductions) in place before the first GEMM; 'after' runs one GEMM first, then
puts them in place (the workspace sizes are read when cuBLAS starts, so they do not count); 'none' never sets them.
For each linear of the Qwen3-0.6B widths (K x N), X is R rows of T tokens: the GEMM over every row at once is
compared bit for bit, row for row, with the same rows in micro-batches of 1 and 4 sequences, and with a decode step's
GEMM (one token of each sequence, M = R).

    python benchmarks/cublas_settings_probe.py [ROWS] [TOKENS]      (prints one line per setting and linear)
"""

from __future__ import annotations

import json
import subprocess
import sys

SHAPES = {"qkv_proj": (1024, 4096), "o_proj": (2048, 1024), "gate_up_proj": (1024, 6144), "down_proj": (3072, 1024),
          "lm_head": (1024, 151936)}
"""Qwen3-0.6B's linears as vLLM runs them (merged q/k/v and gate/up): (in features K, out features N)."""


def one(setting: str, rows: int, tokens: int) -> dict:
    import torch
    import torch.nn.functional as F

    from qualify.examples.vllm_gpu_exact import install_invariant_settings

    if setting == "after":
        a = torch.ones(256, 256, dtype=torch.bfloat16, device="cuda")
        (a @ a).sum().item()
    if setting in ("before", "after"):
        install_invariant_settings()
    g = torch.Generator("cuda").manual_seed(0)
    out = {}
    for name, (k, n) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
        x = torch.randn(rows * tokens, k, device="cuda", generator=g).to(torch.bfloat16)
        whole = F.linear(x, w)
        counts = {}
        for mb in (1, 4):
            step = mb * tokens
            parts = torch.cat([F.linear(x[i:i + step], w) for i in range(0, x.shape[0], step)])
            counts[f"micro-batch {mb}"] = int((parts != whole).any(-1).sum())
        decode = x.view(rows, tokens, k)[:, -1]  # one token of each sequence, as a decode step computes it
        counts["decode step"] = int((F.linear(decode, w) != whole.view(rows, tokens, n)[:, -1]).any(-1).sum())
        out[name] = counts
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    print(f"{rows} sequences x {tokens} tokens: token rows (of {rows * tokens}; decode: of {rows}) whose output is "
          "not bitwise the whole batch's")
    for setting in ("none", "after", "before"):
        done = subprocess.run([sys.executable, __file__, "--one", setting, str(rows), str(tokens)],
                              check=False, capture_output=True, text=True)
        if done.returncode:
            print(f"{setting}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
            continue
        for name, counts in json.loads(done.stdout.strip().splitlines()[-1]).items():
            print(f"{setting:>6} {name:>13}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
