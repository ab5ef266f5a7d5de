"""The committed acceptance replayed on this machine: the HF reference re-scored from the committed rollout.

`frozen_run` scores the reference here from manifests/tiny-qwen3's rollout. It must reproduce the
committed acceptance bitwise when this machine's platform fingerprint and numerics versions are the
acceptance's and every byte reproduces, and within the committed bounds when they are not (or when
bytes differ under a matching fingerprint, which is a hint, never a promise). Every branch is exercised
on whatever machine runs this (another platform by recording one in a copy, moved bytes by moving them),
and a perturbed fresh reference must fail each branch naming the tensor. The negative controls replay
against the acceptance frozen here from the same rollout, so that what they perturb is all that differs.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from qualify.hardware import describe
from qualify.layout import RunLayout
from qualify.replay import BITWISE, BOUNDS, BYTES_DIFFER, judge_replay
from qualify.stages import complete_stage
from qualify.store import read_json, read_tensors, write_json, write_tensors

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "manifests" / "tiny-qwen3" / "acceptance" / "acceptance.json"
TENSOR = "model.layers.1.post_attention_layernorm.weight"


def failing(result):
    return [r for r in result.rows if not r.passed]


def copy_reference(frozen_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(frozen_run / "reference", run / "reference")
    return run


def claim_platform(run: Path, cpu_model: str) -> None:
    layout = RunLayout(run)
    summary = read_json(layout.reference_summary)
    summary["platform"] = summary["platform"] | {"cpu_model": cpu_model}
    write_json(layout.reference_summary, summary)


def perturb_grad(run: Path, role: str, key: str, delta: float | None) -> None:
    """Move one element of one gradient of step 1 of the fresh fp32-r0 run by delta (None: one ulp), and reseal it."""
    d = RunLayout(run).scores("fp32", "r0", role)
    grads = read_tensors(d / "step1" / "grads.safetensors")
    flat = grads[key].clone().view(-1)
    old = flat[0].clone()
    flat[0] = torch.nextafter(old, torch.tensor(float("inf"))) if delta is None else old + delta
    assert flat[0] != old
    grads[key] = flat.view(grads[key].shape)
    write_tensors(d / "step1" / "grads.safetensors", grads)
    complete_stage(d, {})


def cross_an_edge(run: Path, here: Path, precision: str, *, within: bool, step: int = 1) -> tuple[int, int, float, float]:
    """Move one token's ratio in step `step` of the fresh <precision>-r0 actor across its clip edge, as another CPU's
    rounding moves a token that sits near the edge, and reseal. within: the token nearest the edge (its distance
    within the step's frozen ratio bound); else the one farthest from it. Returns (row, token, distance, bound)."""
    from qualify.matrix import load_matrix
    from qualify.ppo.decisions import decisions
    from qualify.reference.inputs import StepInputs

    matrix = load_matrix(REPO / "matrices" / "tiny-qwen3.yaml")
    bound = read_json(here.parent / "bounds" / f"actor-{precision}-repeat.json")["bounds"][
        f"step{step}/outputs/ratio_BT"]["max_abs"]["bound"]
    d = RunLayout(run).scores(precision, "r0", "actor")
    outputs = read_tensors(d / f"step{step}" / "outputs.safetensors")
    inputs = StepInputs.load(matrix.ppo, RunLayout(run), matrix.rollout.vllm_tp[0])
    dec = decisions("actor", matrix.ppo, None, outputs, inputs.targets[step], inputs.masks[step])
    free = torch.isfinite(dec.margin_BT) & ~dec.clipped_BT
    margin = torch.where(free, dec.margin_BT, math.inf if within else -math.inf)
    flat = int(margin.argmin() if within else margin.argmax())
    r, t = divmod(flat, margin.shape[1])
    distance = float(margin[r, t])
    assert (distance < bound / 2) if within else (distance > 2 * bound), (distance, bound)
    adv = float(inputs.targets[step]["advantages_BT"][r, t])
    eps = matrix.ppo.clip_eps
    ratio = outputs["ratio_BT"].clone()
    ratio[r, t] = (1 + eps + bound / 8) if adv > 0 else (1 - eps - bound / 8)  # just past the edge
    write_tensors(d / f"step{step}" / "outputs.safetensors", outputs | {"ratio_BT": ratio})
    complete_stage(d, {})
    return r, t, distance, bound


def test_other_platform_that_decided_a_token_otherwise_near_the_edge_is_judged_on_the_committed_decisions(
        frozen_run, tmp_path):
    here = RunLayout(frozen_run).acceptance
    run = copy_reference(frozen_run, tmp_path)
    claim_platform(run, "Some Other CPU")
    r, t, _, _ = cross_an_edge(run, here, "bf16", within=True)
    result = judge_replay(here, run)
    assert result.passed, [(x.tensor, x.metric, x.value, x.bound, x.note) for x in failing(result)][:5]
    [row] = [x for x in result.rows if x.tensor == "step1/decisions/policy_clip"
             and x.comparison == "fresh vs committed bf16-r0 [bf16-repeat]"]
    assert row.value == 0.0 and f"1 within the bound of the edge (legitimate): row {r} token {t}" in row.note
    assert f"decided 1 token(s) otherwise than the committed one at step 1 (row {r} token {t})" in row.note
    info = result.info["decisions"]["actor bf16-r0"]
    assert info["first_step"] == 1 and info["tokens_decided_otherwise"] == {1: 1}
    assert (run / "replay" / "replays").is_dir()  # this platform's reference replayed on the committed decisions
    # every other run decided as the committed one: judged on its own evidence, nothing replayed
    assert all(v["first_step"] is None for k, v in result.info["decisions"].items() if k != "actor bf16-r0")
    # the gradients of step 1 are the replay's (the committed decisions): a gradient moved there fails by name
    replay = next((run / "replay" / "replays").glob("bf16-r0-*/actor"))
    grads = read_tensors(replay / "step2" / "grads.safetensors")
    bound = read_json(here.parent / "bounds" / "actor-bf16-repeat.json")["bounds"][
        f"step2/grads/{TENSOR}"]["max_abs"]["bound"]
    write_tensors(replay / "step2" / "grads.safetensors", grads | {TENSOR: grads[TENSOR] + 3 * bound})
    complete_stage(replay, {})
    bad = failing(judge_replay(here, run))
    assert bad and {x.tensor for x in bad} == {f"step2/grads/{TENSOR}"}


def test_other_platform_that_decided_a_token_otherwise_far_from_the_edge_fails_naming_it(frozen_run, tmp_path):
    here = RunLayout(frozen_run).acceptance
    run = copy_reference(frozen_run, tmp_path)
    claim_platform(run, "Some Other CPU")
    r, t, _, bound = cross_an_edge(run, here, "fp32", within=False)  # fp32's ratio bound is a few ulps
    bad = failing(judge_replay(here, run))
    [row] = [x for x in bad if x.metric == "unexplained_flips"]
    assert row.tensor == "step1/decisions/policy_clip" and row.value == 1.0
    assert f"1 decided otherwise with the edge beyond the ratio_BT bound {bound:.3g}: row {r} token {t}" in row.note
    # the token's own ratio moved by more than its bound too; nothing else fails
    assert {x.tensor for x in bad} == {"step1/decisions/policy_clip", "step1/outputs/ratio_BT"}


def test_fresh_reference_against_committed_acceptance(frozen_run, capsys):
    result = judge_replay(COMMITTED, frozen_run)
    acceptance = read_json(COMMITTED)
    with capsys.disabled():
        print(f"\ncommitted acceptance frozen on {describe(acceptance['platform'])}; this machine: "
              f"{describe(read_json(RunLayout(frozen_run).reference_summary)['platform'])}")
        judged = [r for r in result.rows if r.bound > 0]
        closest = max(judged, key=lambda r: r.ratio, default=None)
        print(f"replay mode {result.mode}: {len(result.rows)} checks, {len(failing(result))} failing; "
              f"differences: {result.differences or 'none'}; bytes differ: {result.bytes_differ or 'none'}")
        if closest:
            print(f"closest value/bound {closest.ratio:.3f}: {closest.comparison} {closest.tensor} {closest.metric}")
    if result.differences:
        assert result.mode == BOUNDS
    else:  # the same fingerprint: bitwise, or judged within the bounds and saying which files' bytes differed
        assert result.mode == (BYTES_DIFFER if result.bytes_differ else BITWISE)
    assert result.passed, [(r.tensor, r.metric, r.value, r.bound) for r in failing(result)][:5]


def test_other_platform_is_judged_within_the_committed_bounds(frozen_run, tmp_path):
    run = copy_reference(frozen_run, tmp_path)
    claim_platform(run, "Some Other CPU")
    result = judge_replay(COMMITTED, run)
    assert result.mode == BOUNDS and result.bytes_differ == []
    assert any(d.startswith("cpu_model:") for d in result.differences)
    comparisons = {r.comparison for r in result.rows}
    assert comparisons == {"models vs acceptance", "fresh vs committed fp32-r0 [fp32-repeat]",
                           "fresh vs committed bf16-r0 [bf16-repeat]"}
    assert {r.role for r in result.rows if r.comparison != "models vs acceptance"} == {"actor", "critic"}
    assert {r.role for r in result.rows} == {"actor", "critic", "reference", "reward"}  # every model checked
    assert result.passed, [(r.tensor, r.metric, r.value, r.bound) for r in failing(result)][:5]
    assert set(result.info["targets_max_abs"]) >= {"advantages_BT", "returns_BT"}


def test_other_platform_fails_a_gradient_outside_its_bound(frozen_run, tmp_path):
    here = RunLayout(frozen_run).acceptance
    bounds = read_json(here.parent / "bounds" / "actor-fp32-repeat.json")["bounds"][f"step1/grads/{TENSOR}"]
    run = copy_reference(frozen_run, tmp_path)
    claim_platform(run, "Some Other CPU")
    assert judge_replay(here, run).passed
    perturb_grad(run, "actor", TENSOR, 3 * bounds["max_abs"]["bound"])
    bad = failing(judge_replay(here, run))
    key = f"step1/grads/{TENSOR}"
    assert bad and {(r.tensor, r.metric) for r in bad} <= {(key, m) for m in ("max_abs", "rel_l2", "p99_abs", "mean_abs")}
    assert (key, "max_abs") in {(r.tensor, r.metric) for r in bad}


def test_same_platform_judges_bytes_that_move_within_the_bounds_and_says_so(frozen_run, tmp_path):
    here = RunLayout(frozen_run).acceptance
    run = copy_reference(frozen_run, tmp_path)
    result = judge_replay(here, run)
    assert result.mode == BITWISE and result.passed and result.bytes_differ == []
    # one ulp under a matching fingerprint: another CPU of the same description may do this (its math library
    # dispatched otherwise); judged as another platform's, within the committed bounds, and reported as such
    perturb_grad(run, "critic", TENSOR, None)
    result = judge_replay(here, run)
    assert result.differences == [] and result.mode == BYTES_DIFFER
    assert result.bytes_differ == ["scores/fp32-r0/critic/step1/grads.safetensors"]
    assert set(result.bytes_differ) <= set(result.info["bitwise"]["not_reproduced"])
    assert result.passed, [(r.tensor, r.metric, r.value, r.bound) for r in failing(result)][:5]
    assert {r.comparison for r in result.rows} >= {"fresh vs committed fp32-r0 [fp32-repeat]"}
    # forced bitwise still holds the bytes alone to account
    forced = judge_replay(here, run, force_mode=BITWISE)
    assert forced.mode == BITWISE
    assert [r.tensor for r in failing(forced)] == ["scores/fp32-r0/critic/step1/grads.safetensors"]


def test_same_platform_fails_a_gradient_outside_its_bound_naming_it(frozen_run, tmp_path):
    here = RunLayout(frozen_run).acceptance
    bounds = read_json(here.parent / "bounds" / "actor-fp32-repeat.json")["bounds"][f"step1/grads/{TENSOR}"]
    run = copy_reference(frozen_run, tmp_path)
    perturb_grad(run, "actor", TENSOR, 3 * bounds["max_abs"]["bound"])
    result = judge_replay(here, run)
    assert result.differences == [] and result.mode == BYTES_DIFFER
    assert result.bytes_differ == ["scores/fp32-r0/actor/step1/grads.safetensors"]
    bad = failing(result)
    key = f"step1/grads/{TENSOR}"
    assert bad and {(r.tensor, r.metric) for r in bad} <= {(key, m) for m in ("max_abs", "rel_l2", "p99_abs", "mean_abs")}
    [row] = [r for r in bad if r.metric == "max_abs"]
    assert row.comparison == "fresh vs committed fp32-r0 [fp32-repeat]" and row.ratio > 2


def test_same_platform_missing_a_file_fails_naming_it(frozen_run, tmp_path):
    here = RunLayout(frozen_run).acceptance
    run = copy_reference(frozen_run, tmp_path)
    perturb_grad(run, "critic", TENSOR, None)
    missing = RunLayout(run).scores("bf16", "r0", "actor") / "step1" / "grads.safetensors"
    missing.unlink()
    result = judge_replay(here, run)
    assert result.mode == BITWISE and result.bytes_differ == []  # evidence incomplete: not judged within bounds
    assert {(r.tensor, r.note) for r in failing(result)} == {
        ("scores/bf16-r0/actor/step1/grads.safetensors", "missing"),
        ("scores/fp32-r0/critic/step1/grads.safetensors", "bytes differ")}


def test_replay_refuses_a_reference_of_another_rollout(frozen_run, tmp_path):
    from qualify.errors import EvidenceError

    run = copy_reference(frozen_run, tmp_path)
    summary = read_json(RunLayout(run).reference_summary)
    write_json(RunLayout(run).reference_summary, summary | {"rollout_digest": "sha256:" + "0" * 64})
    with pytest.raises(EvidenceError, match="not on the acceptance's"):
        judge_replay(COMMITTED, run)


def test_other_platform_whose_seeded_models_differ_fails_naming_the_weight_file(frozen_run, tmp_path):
    run = copy_reference(frozen_run, tmp_path)
    claim_platform(run, "Some Other CPU")
    weights = RunLayout(run).model("critic") / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    bad = failing(judge_replay(RunLayout(frozen_run).acceptance, run))
    assert [(r.tensor, r.note) for r in bad if r.comparison == "models vs acceptance"] == [
        ("models/critic/model.safetensors", "this platform did not make the acceptance's weights")]
