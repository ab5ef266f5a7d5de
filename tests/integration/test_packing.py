"""Packed sequences on the embedded default (PPO, the committed rollout): a reference with the packed control, then
torch-tp and deepspeed trained on packed micro-batches, judged against the same reference and bounds as their padded
cases (and against those cases, `vs padded`); the four classic packing bugs each fail by at least 10x the bound for
their reason; an engine that does not declare packed batches is refused in one line.

The matrix is matrices/tiny-qwen3.yaml with candidates narrowed to TP1 and the reference's controls to those the
judged engines need beside packed (microbatch_split, attn_impl, combined): a reference of its own, since the session's
frozen_run has no packed control.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from qualify.candidate.stage import run_candidates
from qualify.freeze import freeze
from qualify.matrix import load_matrix
from tests.integration._support import plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.engines]
REPO = Path(__file__).resolve().parents[2]
ROLLOUT = REPO / "manifests" / "tiny-qwen3" / "reference" / "rollout"
PLUGINS = "tests.integration.packing_plugins"
PACK_TOKENS = 128  # the embedded default's rows are 40 tokens but one (28): three micro-batches of 3, 3 and 2 rows


def packed_matrix(path: Path, **candidates):
    """The embedded default with packing: candidates at TP1, padded and packed; the reference's controls narrowed."""
    data = yaml.safe_load((REPO / "matrices" / "tiny-qwen3.yaml").read_text())
    data["candidates"].update({"tp": [1], "packing": ["padded", "packed"], "pack_tokens": PACK_TOKENS} | candidates)
    data["reference"]["perturbations"] = ["microbatch_split", "attn_impl", "packed", "combined"]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_matrix(path)


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory):
    """The packed matrix's reference, scored from the committed rollout, and its acceptance (treat as read-only)."""
    from qualify.reference.stage import run_reference

    base = tmp_path_factory.mktemp("packed")
    run_dir = base / "tiny-qwen3-packed"
    run_reference(packed_matrix(base / "matrix.yaml"), run_dir, rollout=ROLLOUT)
    freeze(run_dir)
    return run_dir


def ratio(row: dict) -> float:
    value, bound = float(row["value"]), float(row["bound"])
    return math.inf if math.isnan(value) else value / bound if bound > 0 else (math.inf if value > 0 else 0.0)


def bounded(row: dict) -> bool:
    """A row judged against a frozen bound family (against the reference, or the padded case), finite and positive."""
    return row["comparison"].startswith("vs ") and 0 < float(row["bound"]) < math.inf


def test_torch_tp_and_deepspeed_pass_packed_within_half_their_bounds(packed_run, tmp_path):
    matrix = packed_matrix(tmp_path / "matrix.yaml", engines=["torch-tp", "deepspeed"])
    verdict = run_candidates(matrix, packed_run, launches=2).to_json()
    failed = [r for r in verdict["rows"] if not r["passed"]]
    assert verdict["passed"] and not failed, failed[:5]
    packed = [c.name for c in matrix.cases() if c.packing == "packed"]
    assert len(packed) == 8 and set(packed) <= set(verdict["cases"])
    for case in packed:
        rows = [r for r in verdict["rows"] if r["case"] == case and bounded(r)]
        assert any(r["comparison"].startswith("vs padded ") for r in rows), case  # judged against its padded case
        closest = max(rows, key=ratio)
        print(f"{case}: closest bound row {ratio(closest):.3f} ({closest['comparison']} {closest['tensor']} "
              f"{closest['metric']})")
        assert ratio(closest) <= 0.5, (case, closest)


@pytest.mark.extended
def test_sharded_engines_pass_packed_ppo_within_half_their_bounds(packed_run, tmp_path):
    """The same for fsdp2 and DeepSpeed ZeRO 1-3 (PPO at TP1, fp32 and bf16, actor and critic, packed only: 16
    cases): every built-in engine that takes packed batches passes a packed PPO matrix."""
    matrix = packed_matrix(tmp_path / "matrix.yaml", packing=["packed"],
                           engines=["fsdp2", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"])
    verdict = run_candidates(matrix, packed_run, launches=2).to_json()
    failed = [(r["case"], r["tensor"], r["note"]) for r in verdict["rows"] if not r["passed"]]
    assert verdict["passed"] and not failed and len(verdict["cases"]) == 16, failed[:5]
    for case in verdict["cases"]:
        closest = max((r for r in verdict["rows"] if r["case"] == case and bounded(r)), key=ratio)
        print(f"{case}: closest bound row {ratio(closest):.3f} ({closest['comparison']} {closest['tensor']} "
              f"{closest['metric']})")
        assert ratio(closest) <= 0.5, (case, closest)


NEGATIVE = {  # plugin factory -> the tensor its bug moves in the first step's forward
    "positions_not_reset": "outputs/logprobs_BT",
    "attention_over_whole_pack": "outputs/logprobs_BT",
    "boundary_token_kept": "outputs/logprobs_BT",
    "cu_seqlens_off_by_one": "outputs/logprobs_BT",
}


@pytest.fixture(scope="module")
def negative_verdict(packed_run, tmp_path_factory):
    """The four packing bugs' packed fp32 actor cases, run once for every control's test."""
    matrix = packed_matrix(tmp_path_factory.mktemp("negative") / "matrix.yaml", precisions=["fp32"], roles=["actor"],
                           packing=["packed"], engines=[f"{PLUGINS}:{name}" for name in NEGATIVE])
    return run_candidates(matrix, packed_run, launches=2).to_json()


@pytest.mark.parametrize("factory", sorted(NEGATIVE))
def test_a_packing_bug_fails_its_logprobs_by_ten_times_the_bound(negative_verdict, factory):
    case = f"{PLUGINS.replace('.', '-')}-{factory}-fp32-tp1-packed-actor"
    rows = [r for r in negative_verdict["rows"] if r["case"] == case]
    assert rows and not negative_verdict["cases"][case]["passed"]
    step0 = [r for r in rows if r["comparison"] == "vs ref fp32-r0 [fp32-repeat]"
             and r["tensor"] == f"step0/{NEGATIVE[factory]}" and r["metric"] == "max_abs"]
    assert len(step0) == 1 and not step0[0]["passed"]
    print(f"{factory}: step0 logprobs_BT max_abs {step0[0]['value']} / bound {step0[0]['bound']} = "
          f"{ratio(step0[0]):.3g}")
    assert ratio(step0[0]) >= 10, step0[0]  # the first step's logprobs, before any update: the forward itself


def test_an_engine_that_does_not_declare_packed_batches_is_refused(packed_run, tmp_path):
    matrix = packed_matrix(tmp_path / "matrix.yaml", precisions=["fp32"], roles=["actor"], packing=["packed"],
                           engines=[f"{PLUGINS}:undeclared"])
    verdict = run_candidates(matrix, packed_run).to_json()
    case = f"{PLUGINS.replace('.', '-')}-undeclared-fp32-tp1-packed-actor"
    (row,) = [r for r in verdict["rows"] if r["case"] == case]
    assert (row["comparison"], row["passed"]) == ("run", False)
    assert f"engine {PLUGINS}:undeclared does not declare packed batches (packed = True" in row["note"]
