"""The reference keeps its controls as summaries (qualify.bounds.records) unless `reference.evidence: full`: freeze
makes the same bound files, byte for byte, from either; a summary is a small fraction of a run kept in full; and a
summary is sealed evidence like the rest (a record changed after the fact is refused, or caught by verify).

frozen_run (tests/conftest.py) is the embedded default under the default, summary; full_run here is the same
reference with every control kept in full, on the same machine, from the same committed rollout.
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from qualify.acceptance import verify_evidence
from qualify.bounds.records import RECORD_FILE
from qualify.errors import EvidenceError
from qualify.freeze import freeze
from qualify.layout import RunLayout
from qualify.stages import complete_stage, stage_info
from qualify.store import read_json
from tests.conftest import COMMITTED, TINY

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    from qualify.matrix import load_matrix
    from qualify.reference.stage import run_reference

    base = tmp_path_factory.mktemp("full-evidence")
    data = yaml.safe_load(TINY.read_text())
    data["reference"]["evidence"] = "full"
    (base / "matrix.yaml").write_text(yaml.safe_dump(data))
    run_dir = base / "tiny-qwen3"
    run_reference(load_matrix(base / "matrix.yaml"), run_dir, rollout=COMMITTED / "reference" / "rollout")
    freeze(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def lean_run(tmp_path_factory):
    """The embedded default's reference under reference.evidence lean (each r0: outputs and gradients), frozen."""
    from qualify.matrix import load_matrix
    from qualify.reference.stage import run_reference

    base = tmp_path_factory.mktemp("lean-evidence")
    data = yaml.safe_load(TINY.read_text())
    data["reference"]["evidence"] = "lean"
    (base / "matrix.yaml").write_text(yaml.safe_dump(data))
    run_dir = base / "tiny-qwen3"
    run_reference(load_matrix(base / "matrix.yaml"), run_dir, rollout=COMMITTED / "reference" / "rollout")
    freeze(run_dir)
    return run_dir


def tree_bytes(path):
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("other", ["full_run", "lean_run"])
def test_summary_full_and_lean_evidence_freeze_the_same_bound_files(frozen_run, other, request):
    other_run = request.getfixturevalue(other)
    for sub in ("bounds", "layers"):
        summary_files = sorted(p.name for p in (RunLayout(frozen_run).acceptance_dir / sub).glob("*.json"))
        assert summary_files and summary_files == sorted(
            p.name for p in (RunLayout(other_run).acceptance_dir / sub).glob("*.json"))
        for name in summary_files:
            a = (RunLayout(frozen_run).acceptance_dir / sub / name).read_bytes()
            b = (RunLayout(other_run).acceptance_dir / sub / name).read_bytes()
            assert a == b, f"{sub}/{name} differs between summary and {other}"


def test_a_lean_r0_keeps_outputs_gradients_and_what_freeze_needs_of_the_rest(frozen_run, lean_run):
    summary, lean = RunLayout(frozen_run), RunLayout(lean_run)
    for precision in ("fp32", "bf16"):
        for role in ("actor", "critic"):
            kept = lean.scores(precision, "r0", role)
            assert list(kept.rglob("grads.safetensors")) and list(kept.rglob("outputs.safetensors"))
            assert not list(kept.rglob("updates.safetensors")) and not list(kept.rglob("moments.safetensors"))
            steps = read_json(kept / RECORD_FILE)["base"]["steps"]
            assert len(steps) == len(list(kept.glob("step*"))) > 1
            assert all(s["update_max_abs"] and s["replay"] and s["start_max_abs"] for s in steps)
            whole = summary.scores(precision, "r0", role)
            # it keeps none of the updates nor the moments
            assert tree_bytes(kept) < tree_bytes(whole) - sum(f.stat().st_size for f in whole.rglob("updates.*"))
    e = read_json(lean.reference_summary)["evidence"]
    # gradients only: 4 bytes per parameter per step for fp32-r0's, 2 for bf16-r0's (bf16 values, kept in bf16:
    # qualify.tensor_codec), plus the files' headers
    assert e["mode"] == "lean" and 3.0 <= e["bytes_per_parameter_step"] < 3.5
    dropped = sum(f.stat().st_size for precision in ("fp32", "bf16") for role in ("actor", "critic")
                  for f in summary.scores(precision, "r0", role).rglob("[um][po]*.safetensors"))  # updates, moments
    # less their records' base (what freeze needs of the updates, a small fraction of them)
    assert e["reference_bytes"] < read_json(summary.reference_summary)["evidence"]["reference_bytes"] - 0.9 * dropped


def test_a_case_is_judged_alike_against_a_lean_reference(run_copy, lean_run, tmp_path):
    """One bf16 torch-tp case's sealed evidence, judged against the summary reference by the candidate stage and again
    against the lean one: the same rows, value for value. Its updates and moments are judged by its own replay and
    derivations either way; the lean r0's absent ones are no structure problem."""
    from qualify.candidate.stage import run_candidates
    from qualify.report_verify import rejudge_problems
    from tests.integration._support import matrix_with

    m = matrix_with(tmp_path, engines=["torch-tp"], precisions=["bf16"], tp=[1], roles=["critic"])
    verdict = run_candidates(m, run_copy).to_json()
    assert verdict["passed"] and any(r["tensor"].startswith("step1/updates/") for r in verdict["rows"])
    lean = tmp_path / "lean"
    shutil.copytree(lean_run, lean)
    shutil.copytree(RunLayout(run_copy).candidates, RunLayout(lean).candidates)
    layout = RunLayout(lean)
    assert rejudge_problems(layout, read_json(layout.reference_summary), read_json(layout.acceptance), verdict,
                            verdict["cases"]) == []


def test_summaries_are_a_small_fraction_of_a_run_kept_in_full(frozen_run, full_run):
    summary, full = RunLayout(frozen_run), RunLayout(full_run)
    controls = read_json(summary.reference_summary)["controls"]
    assert len(controls) > 2
    for precision in ("fp32", "bf16"):
        for role in ("actor", "critic"):
            r0 = tree_bytes(summary.scores(precision, "r0", role))
            record = summary.scores(precision, "r0", role) / RECORD_FILE  # bf16-r0's, as a control of fp32-vs-bf16
            record = record.stat().st_size if record.is_file() else 0  # (a full run keeps the control itself)
            assert r0 - record == pytest.approx(tree_bytes(full.scores(precision, "r0", role)), rel=0.01)  # meta's s
            for control in controls[1:]:
                kept = summary.scores(precision, control, role)
                assert (kept / RECORD_FILE).is_file() and not list(kept.rglob("grads.safetensors"))
                assert tree_bytes(kept) < r0 / 10, (precision, control, role)
                assert list(full.scores(precision, control, role).rglob("grads.safetensors"))
    assert not (summary.reference / "replays").exists() and (full.reference / "replays").is_dir()
    assert not (frozen_run / "reference.work").exists()  # the scratch replays are gone
    assert tree_bytes(summary.reference) < tree_bytes(full.reference) / 5


def test_the_reported_evidence_sizes_are_the_files_on_disk(frozen_run, full_run):
    for run, mode in ((frozen_run, "summary"), (full_run, "full")):
        layout = RunLayout(run)
        e = read_json(layout.reference_summary)["evidence"]
        assert e["mode"] == mode
        # measured before reference.json itself was written
        assert e["reference_bytes"] == tree_bytes(layout.reference) - layout.reference_summary.stat().st_size
        assert e["replays_bytes"] == (tree_bytes(layout.reference / "replays")
                                      if (layout.reference / "replays").exists() else 0)
        # fp32 gradients, updates and both AdamW moments: 16 bytes per parameter per step, but bf16-r0's gradients
        # are bf16 values, kept in bf16 (qualify.tensor_codec): 14 there, 15 on average, plus the files' headers
        assert 14.9 <= e["bytes_per_parameter_step"] < 15.5
    assert read_json(RunLayout(full_run).reference_summary)["evidence"]["summaries"] == 0
    assert read_json(RunLayout(frozen_run).reference_summary)["evidence"]["full_runs"] == 4


def reseal(role_dir, change):
    """Change a sealed record and seal its directory again (what a forger with write access does)."""
    record = read_json(role_dir / RECORD_FILE)
    change(record)
    (role_dir / RECORD_FILE).write_text(json.dumps(record))
    complete_stage(role_dir, stage_info(role_dir))


def test_a_record_holding_another_number_of_steps_is_refused(run_copy):
    layout = RunLayout(run_copy)
    shutil.rmtree(layout.acceptance_dir)
    reseal(layout.scores("bf16", "r1", "actor"),
           lambda r: r["families"]["bf16-repeat"]["steps"].pop())
    with pytest.raises(EvidenceError, match=r"bf16-repeat: the control record of bf16-r1 holds 3 step\(s\) against "
                                            r"bf16-r0, which took 4"):
        freeze(run_copy)


def test_a_record_of_another_schema_is_refused(run_copy):
    layout = RunLayout(run_copy)
    shutil.rmtree(layout.acceptance_dir)
    reseal(layout.scores("fp32", "r1", "critic"), lambda r: r.update(schema="qualify.control-record/0"))
    with pytest.raises(EvidenceError, match="not a control record of schema qualify.control-record/1"):
        freeze(run_copy)


def test_a_lowered_record_sets_a_lower_bound_and_verify_catches_it(run_copy):
    """The record is what the bound is made from: a forger who lowers a control error and reseals its directory
    freezes tighter bounds, and the acceptance frozen before fails verify on that file."""
    layout = RunLayout(run_copy)
    key = "grads/lm_head.weight"
    name = "actor-bf16-repeat.json"
    before = read_json(layout.bounds / name)["bounds"][f"step0/{key}"]["max_abs"]
    acceptance = layout.acceptance.read_bytes()
    victim = layout.scores("bf16", "r1", "actor")

    def lower(record):
        for family in record["families"].values():
            family["steps"][0]["metrics"][key]["max_abs"] = 0.0
    reseal(victim, lower)
    others = [c for c in read_json(layout.reference_summary)["controls"][1:] if c != "r1"]
    for control in others:  # every bf16 control of the family lowered: the family's control error is theirs
        reseal(layout.scores("bf16", control, "actor"), lower)
    report = verify_evidence(layout.acceptance, progress=False)
    assert not report.ok and f"scores/bf16-r1/actor/{RECORD_FILE}" in {m.path for m in report.modified}
    shutil.rmtree(layout.acceptance_dir)
    freeze(run_copy)
    after = read_json(layout.bounds / name)["bounds"][f"step0/{key}"]["max_abs"]
    assert after["control_error"] == 0.0 < before["control_error"] and after["bound"] < before["bound"]
    assert layout.acceptance.read_bytes() != acceptance


def test_each_control_is_measured_against_r0_replayed_on_its_own_decisions(full_run):
    """On the real reference: every control that decided a clip otherwise than its family's r0 (read back here from
    the recorded outputs with the objective's own edges) has a sealed replay, its bound file names it, and the
    family's control error of a gradient is the max over the controls of |control - what it is compared with|,
    computed here without qualify.compare."""
    from qualify.compare import load_steps
    from qualify.matrix import load_matrix
    from qualify.ppo.decisions import decisions, differing
    from qualify.reference.inputs import StepInputs
    from qualify.stages import stage_is_complete
    from tests.conftest import TINY

    layout, matrix = RunLayout(full_run), load_matrix(TINY)
    inputs = StepInputs.load(matrix.ppo, layout, matrix.rollout.vllm_tp[0])
    summary = read_json(layout.reference_summary)
    assert summary["control_replays"], "the embedded default's bf16 controls decide some tokens otherwise than r0"
    replayed = 0
    for path in layout.bounds.glob("*.json"):
        doc = read_json(path)
        role, base = doc["role"], doc["reference_run"]
        base_steps = load_steps(layout.scores(*base.split("-", 1), role))
        theirs = [decisions(role, matrix.ppo, matrix.grpo, s.outputs, inputs.targets[k], inputs.masks[k])
                  for k, s in enumerate(base_steps)]
        worst = [0.0] * len(base_steps)
        for control, compared in doc["compared_with"].items():
            steps = load_steps(layout.scores(*control.split("-", 1), role))
            mine = [decisions(role, matrix.ppo, matrix.grpo, s.outputs, inputs.targets[k], inputs.masks[k])
                    for k, s in enumerate(steps)]
            flipped = any(differing(a, b) for a, b in zip(mine, theirs))
            assert (compared != base) == flipped, (path.name, control, compared)
            if flipped:
                replayed += 1
                assert compared in summary["control_replays"] and stage_is_complete(layout.reference / compared)
            other = load_steps(layout.reference / compared) if flipped else base_steps
            for k, (a, b) in enumerate(zip(steps, other)):
                name = "lm_head.weight" if role == "actor" else "score.weight"
                worst[k] = max(worst[k], float((a.grads[name].double() - b.grads[name].double()).abs().max()))
        for k, w in enumerate(worst):
            name = "lm_head.weight" if role == "actor" else "score.weight"
            got = doc["bounds"][f"step{k}/grads/{name}"]["max_abs"]["control_error"]
            assert got == pytest.approx(w, rel=1e-12, abs=0.0), (path.name, k)
    assert replayed > 0


def test_freeze_refuses_a_reference_whose_control_replay_is_gone(full_run, tmp_path):
    run_copy = tmp_path / "run"
    shutil.copytree(full_run / "reference", run_copy / "reference")
    layout = RunLayout(run_copy)
    victim = layout.reference / read_json(layout.reference_summary)["control_replays"][0]
    shutil.rmtree(victim)
    with pytest.raises(EvidenceError) as caught:
        freeze(run_copy)
    assert str(victim) in str(caught.value) and "'qualify reference' again" in str(caught.value)
    assert not layout.acceptance.exists()


def test_a_lean_r0_without_its_base_record_is_refused(lean_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(lean_run, run)
    layout = RunLayout(run)
    shutil.rmtree(layout.acceptance_dir)
    reseal(layout.scores("fp32", "r0", "critic"), lambda r: r.pop("base"))
    with pytest.raises(EvidenceError, match=r"critic is kept lean \(reference.evidence: lean\) but its record holds no "
                                            r"base record of its 4 step\(s\)"):
        freeze(run)


def test_a_controls_replay_held_in_memory_gives_the_record_of_one_written_to_scratch(full_run, monkeypatch):
    """aligned_base holds r0 replayed on a control's decisions in memory where a run fits in half the available
    memory (no scratch written and read back: 9.5 GB a replay at the Qwen3-0.6B shape) and writes it to scratch
    where it does not: the control's record is the same, number for number, either way."""
    from qualify.compare import load_steps
    from qualify.matrix import load_matrix
    from qualify.models.checkpoint import initial_parameters
    from qualify.reference import forced, summary
    from qualify.reference.context import ScoringContext

    layout = RunLayout(full_run)
    ctx = ScoringContext.of(load_matrix(full_run.parent / "matrix.yaml"), layout)
    controls = read_json(layout.reference_summary)["controls"]
    doc = next(d for d in map(read_json, sorted(layout.bounds.glob("*.json")))
               if any(c != d["reference_run"] for c in d["compared_with"].values()))
    role = doc["role"]
    run_name = next(c for c, compared in doc["compared_with"].items() if compared != doc["reference_run"])
    steps = load_steps(layout.scores(*run_name.split("-", 1), role))
    result = {"meta": steps[0].meta.to_json(), "steps": [
        {"outputs": s.outputs, **{g: dict(getattr(s, g).items()) for g in ("grads", "updates", "moments")}}
        for s in steps]}
    before = initial_parameters(ctx.models[role])

    def record(fits: bool) -> dict:
        monkeypatch.setattr(summary, "replay_fits", lambda *a: fits)
        return summary.control_record(ctx, role, run_name, result, controls, before)

    real_make_replay = forced.make_replay
    monkeypatch.setattr(forced, "make_replay", lambda *a: pytest.fail("the in-memory replay wrote scratch"))
    in_memory = record(True)
    monkeypatch.setattr(forced, "make_replay", real_make_replay)
    in_scratch = record(False)
    assert any(f["compared_with"] != doc["reference_run"] for f in in_memory["families"].values())
    assert json.dumps(in_memory, sort_keys=True) == json.dumps(in_scratch, sort_keys=True)
    assert not layout.scratch_replays.exists() or not any(layout.scratch_replays.rglob("*.safetensors"))

