"""Benchmark the chunked sampler logprobs against the naive formula: peak memory, time, bitwise equality.

Each (variant, mode) runs in a fresh subprocess on the same seeded inputs (bf16 logits by default,
built chunk by chunk so that making them leaves no fp32 peak). Peak memory is the rise of the
process's resident set above what it held once the inputs existed and one warm-up run was done:
/proc/self/status VmHWM after the timed runs minus VmRSS before them, with the high-water mark
reset through /proc/self/clear_refs (on CUDA: torch.cuda.max_memory_allocated above the
allocated bytes). Times are medians of --repeats runs after the warm-up. Modes: 'forward' (no graph) and 'forward+backward' (gradient
of sum(g * logp) with a seeded g). Bitwise equality is checked on the logprobs and the gradient.

    .venv/bin/python benchmarks/logprob_bench.py [--tokens 1024] [--vocab 151936] [--padded-vocab N]
        [--chunk-tokens 64] [--dtype bf16] [--temperature 0.7] [--repeats 3] [--device cpu|cuda]

Ratios are chunked / naive: below 1 means the chunked version uses less memory or time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

MiB = 1 << 20
VARIANTS = ("naive", "chunked")
MODES = ("forward", "forward+backward")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def read_status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{key}:\s+(\d+) kB", status.read(), re.MULTILINE).group(1))


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def make_inputs(args, torch):
    """Seeded (1, tokens, padded_vocab) logits in the benchmark dtype, and tokens below vocab."""
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, DTYPES[args.dtype])
    logits_NV = torch.empty(args.tokens, args.padded_vocab, dtype=dtype)
    for start in range(0, args.tokens, 64):
        rows = logits_NV[start : start + 64]
        rows.copy_(4 * torch.randn(rows.shape, generator=gen))
    tokens_N = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    g_N = torch.randn(args.tokens, generator=gen)
    return logits_NV[None].to(args.device), tokens_N[None].to(args.device), g_N[None].to(args.device)


def run_child(args) -> dict:
    """One (variant, mode) in this process; returns peak bytes, times and digests."""
    import torch

    from qualify.ppo.logprob import naive_sampler_logprobs, sampler_logprobs

    logits_BTV, tokens_BT, g_BT = make_inputs(args, torch)
    backward = args.mode == "forward+backward"
    logits_BTV.requires_grad_(backward)

    def once():
        logits_BTV.grad = None
        if args.variant == "naive":
            logp_BT = naive_sampler_logprobs(logits_BTV, tokens_BT, args.temperature, args.vocab)
        else:
            logp_BT = sampler_logprobs(logits_BTV, tokens_BT, args.temperature, args.chunk_tokens, args.vocab)
        if backward:
            logp_BT.backward(g_BT)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return logp_BT.detach()

    cuda = args.device == "cuda"
    once()  # warm-up: first-use costs (kernel code paged in, thread pools) stay out of the peak
    logits_BTV.grad = None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = read_status_kib("VmRSS") * 1024
        hwm_reset = reset_peak_rss()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        logp_BT = once()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else read_status_kib("VmHWM") * 1024
    grad = logits_BTV.grad
    return {
        "peak_bytes": peak - base,
        "hwm_reset": True if cuda else hwm_reset,
        "median_s": statistics.median(times),
        "logp_sha256": digest(logp_BT, torch),
        "grad_sha256": None if grad is None else digest(grad, torch),
    }


def digest(tensor, torch) -> str:
    """sha256 of the tensor's bytes: equal digests are bitwise equality."""
    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def machine(device: str) -> str:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read(), re.MULTILINE).group(1)
    except (OSError, AttributeError):
        pass
    import torch

    text = f"{os.cpu_count()} CPUs ({model}), torch {torch.__version__}, {torch.get_num_threads()} threads"
    if device == "cuda":
        text += f", {torch.cuda.get_device_name()}"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--padded-vocab", type=int, default=None, help="logits width (default: --vocab)")
    parser.add_argument("--chunk-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.padded_vocab = args.padded_vocab or args.vocab
    if args.child:
        args.variant, args.mode = args.child
        print(json.dumps(run_child(args)))
        return 0

    print(f"machine: {machine(args.device)}")
    print(
        f"inputs: {args.tokens} tokens x {args.padded_vocab} logits ({args.dtype}, vocab {args.vocab}), "
        f"T={args.temperature}, chunk {args.chunk_tokens} tokens, {args.device}, median of {args.repeats}"
    )
    results = {}
    for mode in MODES:
        for variant in VARIANTS:
            command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", variant, mode]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results[variant, mode] = json.loads(out.strip().splitlines()[-1])

    ok = True
    print(
        f"{'mode':<17} {'naive MiB':>10} {'chunked MiB':>12} {'mem ratio':>10} {'naive ms':>10} {'chunked ms':>11} "
        f"{'time ratio':>11}  bitwise"
    )
    for mode in MODES:
        naive, chunked = results["naive", mode], results["chunked", mode]
        mem_ratio = chunked["peak_bytes"] / naive["peak_bytes"]
        bitwise = naive["logp_sha256"] == chunked["logp_sha256"] and naive["grad_sha256"] == chunked["grad_sha256"]
        ok &= bitwise and mem_ratio <= 0.25
        print(
            f"{mode:<17} {naive['peak_bytes'] / MiB:>10.0f} {chunked['peak_bytes'] / MiB:>12.0f} {mem_ratio:>10.3f} "
            f"{naive['median_s'] * 1e3:>10.2f} {chunked['median_s'] * 1e3:>11.2f} "
            f"{chunked['median_s'] / naive['median_s']:>11.2f}"
            f"  {'yes' if bitwise else 'NO'}"
        )
    if not all(r["hwm_reset"] for r in results.values()):
        print("note: /proc/self/clear_refs refused; peaks include everything since process start")
    print("PASS: bitwise equal, chunked peak <= 1/4 of naive" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
