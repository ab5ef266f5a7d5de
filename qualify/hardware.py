"""The platform fingerprint: which CPU, GPU and kernel-affecting settings produced a piece of evidence.

A rollout sampled by vLLM and a reference scored by HF are bitwise reproducible only on the same
platform: the CPU's instruction set picks the ATen/oneDNN kernels (AVX2 vs AVX-512 reduce in other
orders), the thread count splits reductions, the GPU model, driver and CUDA pick GPU kernels, and
TF32 or the attention backend change the arithmetic itself. Every stage records this fingerprint;
`platform_differences` says which of the kernel-selecting fields differ between two of them, so
a consumer knows whether to expect bitwise equality or only agreement within the frozen bounds.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

# CPU flags that select kernels (x86 vector extensions and matrix engines; arm's equivalents).
ISA_PATTERN = re.compile(r"^(sse4_2|fma|f16c|avx\w*|amx\w*|sve\d*|sme\d*|asimd\w*|bf16|i8mm)$")
# The fields whose difference makes bitwise reproduction not expected (the rest is information).
# Environment switches that change kernels' arithmetic; recorded (in settings) only when set.
ENV_KNOBS = ("TRITON_F32_DEFAULT", "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "CUBLAS_WORKSPACE_CONFIG")
KEY_FIELDS = ("machine", "cpu_model", "isa", "torch_cpu_capability", "torch_threads", "gpus", "cuda", "driver",
              "settings")


def _cpuinfo() -> dict[str, str]:
    """The first processor block of /proc/cpuinfo (empty off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info.setdefault(key.strip(), value.strip())
    return info


def cpu_description() -> dict[str, Any]:
    """CPU vendor, model and the kernel-selecting instruction-set features."""
    info = _cpuinfo()
    flags = (info.get("flags") or info.get("Features") or "").split()
    return {"machine": platform.machine(),
            "cpu_vendor": info.get("vendor_id") or info.get("CPU implementer") or "unknown",
            "cpu_model": info.get("model name") or info.get("Model") or platform.processor() or "unknown",
            "isa": sorted(f for f in set(flags) if ISA_PATTERN.match(f)),
            "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def _driver_version() -> str | None:
    try:
        text = Path("/proc/driver/nvidia/version").read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text)
    return match.group(1) if match else text.splitlines()[0].strip()


def torch_description() -> dict[str, Any]:
    """What torch selects kernels by: CPU capability, threads, GPUs, CUDA, and the numerics switches."""
    try:
        import torch
    except ImportError:
        return {"torch": None}
    out: dict[str, Any] = {
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "driver": _driver_version() if torch.cuda.is_available() else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
    }
    settings = {"float32_matmul_precision": torch.get_float32_matmul_precision(),
                "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                "mkldnn": torch.backends.mkldnn.is_available()}
    if torch.cuda.is_available():
        settings |= {**tf32_settings(torch),
                     "cudnn_deterministic": torch.backends.cudnn.deterministic,
                     "cudnn_benchmark": torch.backends.cudnn.benchmark,
                     "sdp_flash": torch.backends.cuda.flash_sdp_enabled(),
                     "sdp_mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                     "sdp_math": torch.backends.cuda.math_sdp_enabled()}
    settings |= {f"env.{k}": os.environ[k] for k in ENV_KNOBS if k in os.environ}
    out["settings"] = settings
    return out


def tf32_settings(torch: Any) -> dict[str, Any]:
    """TF32 as the process holds it. The legacy flags (allow_tf32) raise once the new API set cuDNN's conv and RNN
    apart (vLLM's batch-invariant mode does): then the new API's per-backend precisions are what is recorded."""
    try:
        return {"tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32}
    except RuntimeError:
        return {f"fp32_precision.{name}": str(getattr(backend, "fp32_precision", None))
                for name, backend in (("matmul", torch.backends.cuda.matmul), ("cudnn_conv", torch.backends.cudnn.conv),
                                      ("cudnn_rnn", torch.backends.cudnn.rnn))}


def platform_fingerprint() -> dict[str, Any]:
    """The platform this process runs on (call it where the numbers are made: threads are per process)."""
    return cpu_description() | torch_description()


def platform_differences(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str]:
    """The kernel-selecting fields that differ ('field: a != b'); a missing fingerprint differs in every field."""
    if not a or not b:
        return ["platform: not recorded" if not a else "platform: not recorded on the other side"]
    return [f"{f}: {a.get(f)!r} != {b.get(f)!r}" for f in KEY_FIELDS if a.get(f) != b.get(f)]


def describe(fp: dict[str, Any] | None) -> str:
    """One line for people: 'AMD EPYC 7B13 (avx2, 2 threads)' or '... + 2x NVIDIA H200 (CUDA 13.0)'."""
    if not fp:
        return "not recorded"
    vec = [f for f in fp.get("isa", []) if f.startswith(("avx512f", "amx")) or f == "avx2"]
    line = f"{fp.get('cpu_model', 'unknown')} ({', '.join(vec) or fp.get('machine')}, {fp.get('torch_threads')} threads)"
    if fp.get("gpus"):
        line += f" + {len(fp['gpus'])}x {fp['gpus'][0]} (CUDA {fp.get('cuda')}, driver {fp.get('driver')})"
    return line
