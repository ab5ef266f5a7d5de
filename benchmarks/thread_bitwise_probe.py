"""Does a CPU GEMM's result depend on the intra-op thread count? The embedded default's bf16 and fp32 matmul shapes
(forward, input gradient, weight gradient of a [out, in] linear over T tokens) computed at several thread counts
(a TP2 rank on the CPU runs with half the allocation's cores, qualify.case.launch.launch_env), each compared bit for
bit with the first count's. Prints one line per shape, dtype and count.

Usage: python benchmarks/thread_bitwise_probe.py [THREADS ...]   (default: the allocation's cores, half, 1)
"""

from __future__ import annotations

import os
import sys

import torch


def main(counts: list[int]) -> None:
    cores = len(os.sched_getaffinity(0))
    counts = counts or sorted({cores, max(1, cores // 2), 1}, reverse=True)
    print(f"cores {cores}, thread counts {counts}, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    torch.manual_seed(0)
    shapes = {"lm_head (V=512, H=64)": (512, 64), "mlp up (192, 64)": (192, 64), "mlp down (64, 192)": (64, 192)}
    for T in (240, 480):
        for name, (out_f, in_f) in shapes.items():
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(T, in_f).to(dtype)
                w = (torch.randn(out_f, in_f) * 0.02).to(dtype)
                dy = (torch.randn(T, out_f) * 1e-3).to(dtype)
                results = []
                for n in counts:
                    torch.set_num_threads(n)
                    results.append({"forward": x @ w.t(), "input grad": dy @ w, "weight grad": dy.t() @ x})
                for n, res in zip(counts[1:], results[1:]):
                    diffs = {k: float((v.float() - results[0][k].float()).abs().max()) for k, v in res.items()}
                    same = {k: torch.equal(v, results[0][k]) for k, v in res.items()}
                    print(f"T={T} {name} {str(dtype)[6:]}: {counts[0]} vs {n} threads: " + ", ".join(
                        f"{k} {'bitwise' if same[k] else f'differs (max {diffs[k]:.3g})'}" for k in res))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]])
