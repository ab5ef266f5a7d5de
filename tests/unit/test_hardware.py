"""The platform fingerprint: what it records and which differences excuse bitwise reproduction."""

from __future__ import annotations

import copy

import pytest

from qualify.hardware import (
    ISA_PATTERN,
    KEY_FIELDS,
    cache_sizes,
    cpu_description,
    describe,
    math_library,
    platform_differences,
    platform_fingerprint,
)

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9B14
stepping\t: 1
flags\t\t: fpu sse4_2 avx avx2 avx512f avx512_bf16

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 99
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd sve2 bf16 i8mm
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd4f
CPU revision\t: 1
"""
TORCH_CONFIG = """PyTorch built with:
  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605 for Intel(R) 64 architecture applications
  - Intel(R) MKL-DNN v3.12.0 (Git Hash 80afa71049cd69a3df32adcccb623b12cd7baa22)
  - OpenMP 201511 (a.k.a. OpenMP 4.5)
  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release, LAPACK_INFO=mkl, USE_MKLDNN=ON,
"""


def test_fingerprint_records_cpu_threads_and_settings():
    fp = platform_fingerprint()
    for field in ("machine", "cpu_vendor", "cpu_model", "cpu_id", "cpu_caches", "isa", "torch_cpu_capability",
                  "math_library", "torch_threads", "gpus", "cuda", "driver", "settings"):
        assert field in fp, field
    assert fp["torch_threads"] >= 1
    assert fp["settings"]["float32_matmul_precision"] in ("highest", "high", "medium")
    assert isinstance(fp["settings"]["deterministic_algorithms"], bool)
    assert all(ISA_PATTERN.match(f) for f in fp["isa"])


def test_fingerprint_records_what_decides_cpu_kernels():
    fp = platform_fingerprint()
    assert fp["cpu_id"] is None or (fp["cpu_id"] and all(isinstance(v, int | str) for v in fp["cpu_id"].values()))
    assert fp["cpu_caches"] is None or all(k.startswith("L") and v > 0 for k, v in fp["cpu_caches"].items())
    lib = fp["math_library"]
    assert set(lib) == {"blas", "lapack", "mkl", "onednn", "openmp", "mkl_available", "onednn_acl"}
    assert all(lib[k] is None or isinstance(lib[k], str) for k in ("blas", "lapack", "mkl", "onednn", "openmp"))
    assert isinstance(lib["mkl_available"], bool) and isinstance(lib["onednn_acl"], bool)
    assert isinstance(fp["settings"]["mkldnn_enabled"], bool)


def test_cpu_identification_is_read_from_the_first_processor_x86_and_arm(tmp_path):
    (tmp_path / "x86").write_text(X86_CPUINFO)
    (tmp_path / "arm").write_text(ARM_CPUINFO)
    x86 = cpu_description(tmp_path / "x86", tmp_path / "no-caches")
    assert x86["cpu_id"] == {"family": 25, "model": 17, "stepping": 1}
    assert x86["cpu_model"] == "AMD EPYC 9B14" and x86["isa"] == ["avx", "avx2", "avx512_bf16", "avx512f", "sse4_2"]
    arm = cpu_description(tmp_path / "arm", tmp_path / "no-caches")
    assert arm["cpu_id"] == {"implementer": 0x41, "architecture": 8, "variant": 0, "part": 0xD4F, "revision": 1}
    assert arm["isa"] == ["asimd", "bf16", "i8mm", "sve2"]


def test_missing_cpuinfo_and_cache_directories_give_none_not_a_crash(tmp_path):
    desc = cpu_description(tmp_path / "no-cpuinfo", tmp_path / "no-caches")
    assert desc["cpu_id"] is None and desc["cpu_caches"] is None and desc["cpu_model"]
    (tmp_path / "empty").mkdir()
    assert cache_sizes(tmp_path / "empty") is None
    partial = tmp_path / "partial" / "index0"
    partial.mkdir(parents=True)
    (partial / "level").write_text("1\n")  # no type, no size: skipped
    assert cache_sizes(tmp_path / "partial") is None


def _cache(root, index, level, kind, size):
    d = root / f"index{index}"
    d.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size)):
        (d / name).write_text(f"{value}\n")


def test_cache_sizes_are_data_and_unified_levels_in_bytes(tmp_path):
    for index, (level, kind, size) in enumerate([(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                                  (3, "Unified", "32M")]):
        _cache(tmp_path, index, level, kind, size)
    assert cache_sizes(tmp_path) == {"L1d": 32 << 10, "L2": 1 << 20, "L3": 32 << 20}


def test_math_library_is_read_from_torch_build_text():
    assert math_library(TORCH_CONFIG) == {"blas": "mkl", "lapack": "mkl", "mkl": "2024.2-Product Build 20240605",
                                          "onednn": "v3.12.0 80afa71049cd69a3df32adcccb623b12cd7baa22",
                                          "openmp": "201511"}
    assert math_library("PyTorch built with:\n  - Build settings: BLAS_INFO=open, LAPACK_INFO=open,\n") == {
        "blas": "open", "lapack": "open", "mkl": None, "onednn": None, "openmp": None}


@pytest.mark.parametrize(("field", "change"), [
    ("cpu_id", {"family": 25, "model": 17, "stepping": 1}),
    ("cpu_id", {"family": 25, "model": 1, "stepping": 2}),
    ("cpu_caches", {"L1d": 32 << 10, "L2": 1 << 20, "L3": 32 << 20}),
    ("math_library", {"onednn": "v3.7.1 8d263e693366ef8db40acc569cc7d8edf644556d"}),
])
def test_fingerprints_that_differ_only_in_what_decides_cpu_kernels_differ(field, change):
    here = platform_fingerprint() | {"cpu_id": {"family": 25, "model": 1, "stepping": 1},
                                     "cpu_caches": {"L1d": 32 << 10, "L2": 512 << 10, "L3": 32 << 20}}
    other = copy.deepcopy(here)
    other[field] = (other[field] or {}) | change
    diffs = platform_differences(here, other)
    assert len(diffs) == 1 and diffs[0].startswith(f"{field}:"), diffs


def test_an_old_fingerprint_without_the_new_fields_differs_in_them():
    here = platform_fingerprint()
    old = {k: v for k, v in here.items() if k not in ("cpu_id", "cpu_caches", "math_library")}
    fields = [d.split(":")[0] for d in platform_differences(old, here)]
    assert set(fields) <= {"cpu_id", "cpu_caches", "math_library"} and "math_library" in fields


def test_isa_keeps_vector_and_matrix_extensions_only():
    flags = ["fpu", "avx", "avx2", "avx512f", "avx512_bf16", "amx_tile", "smep", "smap", "sse4_2", "sse2", "fma",
             "sve2", "sme", "asimd", "asimdhp", "i8mm"]
    kept = [f for f in flags if ISA_PATTERN.match(f)]
    assert kept == ["avx", "avx2", "avx512f", "avx512_bf16", "amx_tile", "sse4_2", "fma", "sve2", "sme", "asimd",
                    "asimdhp", "i8mm"]


def test_same_platform_has_no_differences():
    fp = platform_fingerprint()
    assert platform_differences(fp, copy.deepcopy(fp)) == []


def test_every_key_field_difference_is_named():
    fp = platform_fingerprint()
    for field in KEY_FIELDS:
        other = copy.deepcopy(fp)
        other[field] = "something else"
        diffs = platform_differences(fp, other)
        assert len(diffs) == 1 and diffs[0].startswith(f"{field}:"), (field, diffs)


def test_information_fields_do_not_break_bitwise_expectation():
    fp = platform_fingerprint()
    other = copy.deepcopy(fp) | {"cpus_allowed": 999, "cpu_vendor": fp["cpu_vendor"]}
    assert platform_differences(fp, other) == []


def test_missing_fingerprint_is_a_difference():
    fp = platform_fingerprint()
    assert platform_differences(None, fp) == ["platform: not recorded"]
    assert platform_differences(fp, {}) == ["platform: not recorded on the other side"]


def test_describe_is_one_line():
    fp = platform_fingerprint() | {"cpu_model": "Example CPU", "isa": ["avx2", "avx512f"], "torch_threads": 2,
                                   "cpu_id": {"family": 25, "model": 17, "stepping": 1},
                                   "gpus": ["NVIDIA H200", "NVIDIA H200"], "cuda": "13.0", "driver": "580.1"}
    line = describe(fp)
    assert line == ("Example CPU (family 25 model 17 stepping 1, avx2, avx512f, 2 threads) "
                    "+ 2x NVIDIA H200 (CUDA 13.0, driver 580.1)")
    arm = fp | {"cpu_model": "unknown", "isa": ["asimd"], "machine": "aarch64", "gpus": [],
                "cpu_id": {"implementer": 0x41, "architecture": 8, "variant": 0, "part": 0xD4F, "revision": 1}}
    assert describe(arm) == "unknown (implementer 0x41 variant 0 part 0xd4f revision 1, aarch64, 2 threads)"
    assert describe(fp | {"cpu_id": None, "gpus": []}) == "Example CPU (avx2, avx512f, 2 threads)"
    assert describe(None) == "not recorded"


def test_kernel_switches_in_the_environment_are_recorded_only_when_set(monkeypatch):
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    assert "env.TRITON_F32_DEFAULT" not in platform_fingerprint()["settings"]
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32")
    with_tf32 = platform_fingerprint()
    assert with_tf32["settings"]["env.TRITON_F32_DEFAULT"] == "tf32"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    assert platform_differences(with_tf32, platform_fingerprint())[0].startswith("settings:")


def test_a_cap_on_the_isa_onednn_dispatches_to_is_a_difference(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    free = platform_fingerprint()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = platform_fingerprint()
    assert capped["settings"]["env.ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert [d.split(":")[0] for d in platform_differences(free, capped)] == ["settings"]


def test_vllm_child_runs_with_ieee_fp32_dots_unless_told_otherwise(monkeypatch):
    from qualify.rollout.capture import vllm_env

    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    assert vllm_env(1)["TRITON_F32_DEFAULT"] == "ieee"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32")
    assert vllm_env(1)["TRITON_F32_DEFAULT"] == "tf32"
