"""The platform fingerprint: what it records and which differences excuse bitwise reproduction."""

from __future__ import annotations

import copy

from qualify.hardware import ISA_PATTERN, KEY_FIELDS, describe, platform_differences, platform_fingerprint


def test_fingerprint_records_cpu_threads_and_settings():
    fp = platform_fingerprint()
    for field in ("machine", "cpu_vendor", "cpu_model", "isa", "torch_cpu_capability", "torch_threads", "gpus",
                  "cuda", "driver", "settings"):
        assert field in fp, field
    assert fp["torch_threads"] >= 1
    assert fp["settings"]["float32_matmul_precision"] in ("highest", "high", "medium")
    assert isinstance(fp["settings"]["deterministic_algorithms"], bool)
    assert all(ISA_PATTERN.match(f) for f in fp["isa"])


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
                                   "gpus": ["NVIDIA H200", "NVIDIA H200"], "cuda": "13.0", "driver": "580.1"}
    line = describe(fp)
    assert line == "Example CPU (avx2, avx512f, 2 threads) + 2x NVIDIA H200 (CUDA 13.0, driver 580.1)"
    assert describe(None) == "not recorded"


def test_kernel_switches_in_the_environment_are_recorded_only_when_set(monkeypatch):
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    assert "env.TRITON_F32_DEFAULT" not in platform_fingerprint()["settings"]
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32")
    with_tf32 = platform_fingerprint()
    assert with_tf32["settings"]["env.TRITON_F32_DEFAULT"] == "tf32"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    assert platform_differences(with_tf32, platform_fingerprint())[0].startswith("settings:")


def test_vllm_child_runs_with_ieee_fp32_dots_unless_told_otherwise(monkeypatch):
    from qualify.rollout.capture import vllm_env

    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    assert vllm_env(1)["TRITON_F32_DEFAULT"] == "ieee"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32")
    assert vllm_env(1)["TRITON_F32_DEFAULT"] == "tf32"
