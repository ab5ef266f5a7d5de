"""The platform fingerprint: which CPU, GPU and kernel-affecting settings produced a piece of evidence.

A rollout sampled by vLLM and a reference scored by HF are bitwise reproducible only on the same
platform: the CPU's instruction set picks the ATen/oneDNN kernels (AVX2 vs AVX-512 reduce in other
orders), the CPU's family, model and stepping and its cache sizes pick oneDNN's and MKL's code paths and
blockings, the math library's build (oneDNN, MKL or OpenBLAS versions) and its ISA switches decide the rest,
the thread count splits reductions, the GPU model, driver and CUDA pick GPU kernels, and TF32 or the
attention backend change the arithmetic itself. Every stage records this fingerprint; `platform_differences`
says which of the kernel-selecting fields differ between two of them, so a consumer knows whether to expect
bitwise equality or only agreement within the frozen bounds. Equal fingerprints are a hint, never a promise:
what a library dispatches to is not all visible from Python, so a consumer that finds bytes moving under an
equal fingerprint judges them as another platform's (qualify.replay).
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

# CPU flags that select kernels (x86 vector extensions and matrix engines; arm's equivalents).
ISA_PATTERN = re.compile(r"^(sse4_2|fma|f16c|avx\w*|amx\w*|sve\d*|sme\d*|asimd\w*|bf16|i8mm)$")
# Environment switches that change kernels' arithmetic or the ISA a math library dispatches to (oneDNN's and MKL's
# caps: what they dispatch to is the CPU's ISA under these); recorded (in settings) only when set.
ENV_KNOBS = ("TRITON_F32_DEFAULT", "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "CUBLAS_WORKSPACE_CONFIG",
             "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE",
             "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")
# The fields whose difference makes bitwise reproduction not expected (the rest is information).
KEY_FIELDS = ("machine", "cpu_model", "cpu_id", "cpu_caches", "isa", "torch_cpu_capability", "math_library",
              "torch_threads", "gpus", "cuda", "driver", "settings")
# /proc/cpuinfo's identification of a core: x86's family, model and stepping; arm's implementer, variant, part and
# revision (the name each is recorded under).
CPU_ID_KEYS = {"cpu family": "family", "model": "model", "stepping": "stepping", "CPU implementer": "implementer",
               "CPU architecture": "architecture", "CPU variant": "variant", "CPU part": "part",
               "CPU revision": "revision"}
CPUINFO = Path("/proc/cpuinfo")
CPU0_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _cpuinfo(path: Path = CPUINFO) -> dict[str, str]:
    """The first processor block of /proc/cpuinfo (empty off Linux)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info.setdefault(key.strip(), value.strip())
    return info


def cpu_description(cpuinfo: Path = CPUINFO, caches: Path = CPU0_CACHES) -> dict[str, Any]:
    """CPU vendor, model, its identification and caches, and the kernel-selecting instruction-set features."""
    info = _cpuinfo(cpuinfo)
    flags = (info.get("flags") or info.get("Features") or "").split()
    return {"machine": platform.machine(),
            "cpu_vendor": info.get("vendor_id") or info.get("CPU implementer") or "unknown",
            "cpu_model": info.get("model name") or info.get("Model") or platform.processor() or "unknown",
            "cpu_id": cpu_id(info),
            "cpu_caches": cache_sizes(caches),
            "isa": sorted(f for f in set(flags) if ISA_PATTERN.match(f)),
            "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def _number(text: str) -> int | str:
    """'25' -> 25, '0x41' -> 65; anything else as written."""
    try:
        return int(text, 16) if text.lower().startswith("0x") else int(text)
    except ValueError:
        return text


def cpu_id(info: dict[str, str]) -> dict[str, int | str] | None:
    """The core's identification from a /proc/cpuinfo block: {'family': 25, 'model': 17, 'stepping': 1} on x86,
    {'implementer': 65, 'variant': 3, 'part': 3340, 'revision': 1, ...} on arm; None when the block has none."""
    found = {name: _number(info[key]) for key, name in CPU_ID_KEYS.items() if info.get(key)}
    return found or None


def cache_sizes(root: Path = CPU0_CACHES) -> dict[str, int] | None:
    """Bytes of each data or unified cache level of a core, from sysfs (index*/{level,type,size}):
    {'L1d': 32768, 'L2': 524288, 'L3': 33554432}; instruction caches left out; None when sysfs says nothing."""
    sizes: dict[str, int] = {}
    try:
        indexes = sorted(Path(root).glob("index*"))
    except OSError:
        return None
    for index in indexes:
        try:
            level, kind, size = ((index / f).read_text(errors="replace").strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        match = re.fullmatch(r"(\d+)\s*([KMG]?)i?B?", size, re.IGNORECASE)
        if kind == "Instruction" or not match:
            continue
        sizes[f"L{level}{'d' if kind == 'Data' else ''}"] = int(match.group(1)) * SIZE_UNITS[match.group(2).upper()]
    return dict(sorted(sizes.items())) or None


def math_library(config: str) -> dict[str, Any]:
    """The CPU math libraries torch was built with, from torch.__config__.show(): BLAS and LAPACK providers, MKL's
    and oneDNN's versions (oneDNN's with its git hash). A fact the text does not state is None."""
    def find(pattern: str) -> str | None:
        match = re.search(pattern, config)
        return " ".join(g for g in match.groups() if g) if match else None

    return {"blas": find(r"BLAS_INFO=([^,\s]+)"), "lapack": find(r"LAPACK_INFO=([^,\s]+)"),
            "mkl": find(r"Math Kernel Library Version ([^\n]+?)\s+for "),
            "onednn": find(r"(?:MKL-DNN|oneDNN) (v?[0-9][\w.]*)(?: \(Git Hash ([0-9a-f]+)\))?"),
            "openmp": find(r"OpenMP (\d+)")}


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
        "math_library": math_library(torch.__config__.show()) | {
            "mkl_available": torch.backends.mkl.is_available(),
            "onednn_acl": bool(getattr(torch._C, "_has_mkldnn_acl", False))},
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
                "mkldnn": torch.backends.mkldnn.is_available(), "mkldnn_enabled": torch.backends.mkldnn.enabled,
                **onednn_precisions(torch)}
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


def onednn_precisions(torch: Any) -> dict[str, str]:
    """oneDNN's fp32 precisions ('none' keeps fp32; 'bf16' or 'tf32' computes fp32 matmuls and convolutions in
    them), where this torch has the API."""
    try:
        return {f"fp32_precision.mkldnn_{name}": str(getattr(torch.backends.mkldnn, name).fp32_precision)
                for name in ("matmul", "conv")}
    except (AttributeError, RuntimeError):
        return {}


def platform_fingerprint() -> dict[str, Any]:
    """The platform this process runs on (call it where the numbers are made: threads are per process)."""
    return cpu_description() | torch_description()


def platform_differences(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str]:
    """The kernel-selecting fields that differ ('field: a != b'); a missing fingerprint differs in every field."""
    if not a or not b:
        return ["platform: not recorded" if not a else "platform: not recorded on the other side"]
    return [f"{f}: {a.get(f)!r} != {b.get(f)!r}" for f in KEY_FIELDS if a.get(f) != b.get(f)]


def describe(fp: dict[str, Any] | None) -> str:
    """One line for people: 'AMD EPYC (family 25 model 17 stepping 1, avx2, avx512f, 2 threads)' or
    '... + 2x NVIDIA H200 (CUDA 13.0, driver 580.1)'."""
    if not fp:
        return "not recorded"
    vec = [f for f in fp.get("isa", []) if f.startswith(("avx512f", "amx")) or f == "avx2"]
    ident = " ".join(f"{k} {hex(v) if k in ('implementer', 'part') and isinstance(v, int) else v}"
                     for k, v in (fp.get("cpu_id") or {}).items() if k != "architecture")
    parts = ([ident] if ident else []) + (vec or [str(fp.get("machine"))]) + [f"{fp.get('torch_threads')} threads"]
    line = f"{fp.get('cpu_model', 'unknown')} ({', '.join(parts)})"
    if fp.get("gpus"):
        line += f" + {len(fp['gpus'])}x {fp['gpus'][0]} (CUDA {fp.get('cuda')}, driver {fp.get('driver')})"
    return line
