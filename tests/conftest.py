"""Shared fixtures: marker-driven skips and one reference + freeze per test session.

Markers skip themselves when what they need is missing: vllm (vLLM importable), slurm (a Slurm
controller answers), gpu / multi_gpu (CUDA devices). In CI (CI=true) a missing vLLM or Slurm fails
the tests that need them, and a missing deepspeed or megatron-core fails the integration run. The session fixture `frozen_run` captures the
embedded default's rollout with real vLLM, scores the reference and freezes it once; every test
that needs a reference uses it (read-only) or copies it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "matrices" / "tiny-qwen3.yaml"
GRPO = REPO / "matrices" / "tiny-qwen3-grpo.yaml"

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def _has_vllm() -> bool:
    return _importable("vllm")


def _slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _num_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


# In CI (CI=true) what these markers and modules stand for is installed and started by .ci/run: a test that
# needs one that is missing fails there instead of skipping. GPUs are not among them (CI has none).
CI_REQUIRED_MARKERS = ("vllm", "slurm")
CI_REQUIRED_MODULES = ("deepspeed", "megatron.core")  # integration tests importorskip or skipif on them


EXTENDED_ENV = "QUALIFY_EXTENDED"
"""Set to 1 to run the extended sweeps too (pytest.mark.extended: TESTING.md, 'The extended sweeps')."""


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def _fail_in_ci(item: pytest.Item, reason: str) -> None:
    """Make item fail with reason, without setting up its fixtures (they need what is missing)."""
    def fail() -> None:
        pytest.fail(f"CI=true: {reason}; a test CI must run fails here instead of skipping", pytrace=False)

    item.setup = lambda: None
    item.runtest = fail


def pytest_collection_modifyitems(config, items):
    checks = {"vllm": (_has_vllm, "vLLM is not importable"),
              "slurm": (_slurm_up, "no Slurm controller answers (start one with scripts/slurm-local.sh)"),
              "gpu": (lambda: _num_gpus() >= 1, "no CUDA GPU"),
              "multi_gpu": (lambda: _num_gpus() >= 2, "fewer than two CUDA GPUs")}
    cache: dict[str, bool] = {}
    ci = _in_ci()
    extended = os.environ.get(EXTENDED_ENV, "").strip().lower() in ("1", "true")
    for item in items:
        if "extended" in item.keywords and not extended:
            item.add_marker(pytest.mark.skip(reason=f"an extended sweep: {EXTENDED_ENV}=1 (make test-extended) runs it"))
            continue
        for marker, (probe, reason) in checks.items():
            if marker in item.keywords:
                if marker not in cache:
                    cache[marker] = probe()
                if cache[marker]:
                    continue
                if ci and marker in CI_REQUIRED_MARKERS:
                    _fail_in_ci(item, reason)
                else:
                    item.add_marker(pytest.mark.skip(reason=reason))
    integration = REPO / "tests" / "integration"
    if ci and any(integration in Path(str(item.path)).parents for item in items):
        missing = [name for name in CI_REQUIRED_MODULES if not _importable(name)]
        if missing:  # the modules' tests skip themselves at import, before there is an item to fail
            raise pytest.UsageError(f"CI=true: {', '.join(missing)} not importable; the integration tests that "
                                    "need them would skip (install them with scripts/install.sh)")


@pytest.fixture(scope="session")
def grpo_matrix():
    from qualify.matrix import load_matrix

    return load_matrix(GRPO)


@pytest.fixture(scope="session")
def grpo_run(tmp_path_factory, grpo_matrix):
    """The GRPO matrix's reference (real vLLM capture) and acceptance, once per session (treat as read-only)."""
    from qualify.freeze import freeze
    from qualify.reference.stage import run_reference

    run_dir = tmp_path_factory.mktemp("grpo") / "tiny-qwen3-grpo"
    run_reference(grpo_matrix, run_dir)
    freeze(run_dir)
    return run_dir


@pytest.fixture(scope="session")
def tiny_matrix():
    from qualify.matrix import load_matrix

    return load_matrix(TINY)


COMMITTED = REPO / "manifests" / "tiny-qwen3"


@pytest.fixture(scope="session")
def frozen_run(tmp_path_factory, tiny_matrix):
    """Run directory with the embedded default's reference and acceptance (treat as read-only).

    The reference is scored here, on this machine, from the committed rollout (a rollout is
    platform-specific evidence: it is carried, not re-sampled); freeze makes this machine's own
    acceptance from it. Capturing with real vLLM is tested on its own (test_capture.py).
    """
    from qualify.freeze import freeze
    from qualify.reference.stage import run_reference

    run_dir = tmp_path_factory.mktemp("frozen") / "tiny-qwen3"
    run_reference(tiny_matrix, run_dir, rollout=COMMITTED / "reference" / "rollout")
    freeze(run_dir)
    return run_dir


@pytest.fixture
def run_copy(frozen_run, tmp_path):
    """A private copy of the frozen run (reference + acceptance, no candidates) a test may change."""
    dst = tmp_path / "run"
    shutil.copytree(frozen_run / "reference", dst / "reference")
    shutil.copytree(frozen_run / "acceptance", dst / "acceptance")
    return dst
