"""Helpers shared by the engine integration tests: plugin modules importable by workers, matrix variants."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qualify.matrix import load_matrix
from qualify.store import read_json

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def plugins_importable(monkeypatch):
    """Workers launched by torchrun import 'tests.integration.*' plugin engines from the repo root."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def matrix_with(tmp_path: Path, base: Path = REPO / "matrices" / "tiny-qwen3.yaml", **candidates):
    """The embedded default's matrix (or base) with its candidates section changed, written under tmp_path."""
    data = yaml.safe_load(Path(base).read_text())
    data["candidates"].update(candidates)
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_matrix(path)


def require_module(name: str):
    """Import name; outside CI a missing module skips the test, in CI (CI=true) it fails it."""
    import importlib

    if os.environ.get("CI", "").strip().lower() in ("true", "1"):
        return importlib.import_module(name)
    return pytest.importorskip(name)


# --- assertions that read the evidence themselves instead of trusting a check's own 'passed' ----------------------

def agreement_bound(rule: dict, frozen_control: float) -> float:
    """The frozen rule applied to a frozen control of a logprob comparison: k x control + logprob floor
    (how qualify.rounds bounds vLLM against HF fp32)."""
    return float(rule["k"]) * float(frozen_control) + float(rule["floors"]["logprob"])


def exceeds(row: dict) -> bool:
    """The row's value is above its bound, read from the numbers (a JSON row writes inf as a string)."""
    value, bound = float(row["value"]), float(row["bound"])
    return math.isnan(value) or value > bound  # NaN exceeds every bound


def rows_for(verdict: dict, case: str, tensor: str, family: str) -> list[dict]:
    """The rows of case judging tensor ('outputs/logprobs_BT', any step) in comparisons of family ('fp32-vs-bf16')."""
    return [r for r in verdict["rows"] if r["case"] == case and r["comparison"].endswith(f"[{family}]")
            and (r["tensor"] == tensor or r["tensor"].endswith("/" + tensor))]


AFTER_FAILED = {"generate": "unusable", "install": "unusable", "state": "failed"}


def probe_problems(probe: str, outcome: dict, *, tp: int, num_layers: int) -> list[str]:
    """Why a rounds probe's outcome does not show its fault rejected for the reason it targets (empty: it does).

    Read from what the engine answered (its reply, the problems it named, its state afterwards), never
    from the probe's own 'passed'. Every problem named must be the injected fault, and there must be one.
    """
    out = []
    if probe.startswith("stale"):
        reply, state = outcome.get("reply") or {}, outcome.get("state_after") or {}
        if reply.get("ok") is not False or reply.get("kind") != "stale_version":
            out.append(f"reply {reply!r} is not a stale_version refusal")
        if (state.get("state"), state.get("version")) != ("ready", 0):
            out.append(f"engine after the refusal: {state!r}, not ready at v0")
        return out
    last = tp - 1
    target = f"model.layers.{num_layers - 1}.mlp.down_proj.weight"
    is_the_fault = {"wrong-shard": lambda p: p.startswith(f"rank {last}: {target} holds "),
                    "missing-ack": lambda p: p == f"rank {last}: no acknowledgment",
                    "duplicate-ack": lambda p: p == "rank 0: 2 acknowledgments (duplicate)"}[probe]
    problems = outcome.get("problems") or []
    if outcome.get("observed") != "install_failed":
        out.append(f"observed {outcome.get('observed')!r}, not install_failed")
    if not problems:
        out.append("the engine named no problem")
    out += [f"named a problem that is not the fault: {p!r}" for p in problems if not is_the_fault(p)]
    after = outcome.get("after") or {}
    seen = {"generate": after.get("generate"), "install": after.get("install"),
            "state": (after.get("state") or {}).get("state")}
    if seen != AFTER_FAILED:
        out.append(f"after the failed install: {seen}, not {AFTER_FAILED}")
    return out


BF16_TEMPERATURE_CASE = "tests-integration-plugins-bf16_temperature-{}-tp1-actor"


def bf16_temperature_problems(verdict: dict) -> list[str]:
    """What the bf16-temperature control must show, read from the rows' numbers: the fp32 case's logprobs
    exceed the fp32-repeat bound; the bf16 case is judged against bf16 r0 and against fp32 r0 (both comparisons
    present and measured), and the fp32 case is not compared with bf16 at all."""
    case = BF16_TEMPERATURE_CASE
    fp32, bf16 = case.format("fp32"), case.format("bf16")
    out = []
    repeat = rows_for(verdict, fp32, "outputs/logprobs_BT", "fp32-repeat")
    if not any(exceeds(r) for r in repeat):
        out.append(f"{fp32}: no fp32-repeat logprob row above its bound: {repeat}")
    if rows_for(verdict, fp32, "outputs/logprobs_BT", "fp32-vs-bf16"):
        out.append(f"{fp32}: compared with the bf16 family")
    for family in ("bf16-repeat", "fp32-vs-bf16"):
        rows = rows_for(verdict, bf16, "outputs/logprobs_BT", family)
        if not rows or any(r["note"] == "not measured" for r in rows):
            out.append(f"{bf16}: logprobs not judged in {family}: {rows}")
    return out


def copy_run(frozen_run, dst):
    """A new run holding frozen_run's reference and acceptance (for a rounds run of its own)."""
    for part in ("reference", "acceptance"):
        shutil.copytree(frozen_run / part, dst / part)
    return dst


def forged_copy(run, tmp_path, edit, tp: int = 1):
    """A copy of the rounds run (vLLM TP tp) with edit(rounds_dir, verdict) applied and the stage sealed again over it (what a
    writer who recomputes the completion marker's sha256 list does); the report's verification of the copy."""
    from qualify.layout import RunLayout
    from qualify.report import load_docs
    from qualify.report_verify import verify_run
    from qualify.stages import complete_stage, stage_info
    from qualify.store import write_json

    copy = tmp_path / "forged"
    shutil.copytree(run, copy)
    out = RunLayout(copy).rounds_dir(tp)
    verdict = read_json(out / "verdict.json")
    edit(out, verdict)
    write_json(out / "verdict.json", verdict)
    complete_stage(out, stage_info(out) | {"passed": verdict["passed"]})
    docs = load_docs(copy)
    return verify_run(docs.layout, docs.reference, docs.acceptance, docs.verdict, docs.rounds).problems


KILLED_WRITER = """
import sys, time
from pathlib import Path
from qualify.store import atomic_write

def half_then_hang(tmp):
    tmp.write_text("half")
    print("writing", flush=True)
    time.sleep(600)

atomic_write(Path(sys.argv[1]), half_then_hang)
"""


def killed_writer(target: Path, kill: bool = True) -> subprocess.Popen:
    """A process that starts the atomic write of target and is killed (SIGKILL) midway, as a freeze or a report killed
    by a scheduler is: its temp file stays behind. kill=False: it is left hanging (alive) mid-write."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], stdout=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.stdout.readline() == "writing\n"
    if kill:
        proc.kill()
        proc.wait()
    return proc
