"""A case's spec becomes its engine's context in one place (qualify.case.spec.engine_context), so the candidate
worker's engine and diagnose's are set up alike: every field the context shares with the spec is the spec's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from qualify.case.spec import engine_context, make_spec
from qualify.engines.base import EngineContext
from qualify.matrix import load_matrix

MATRICES = Path(__file__).resolve().parents[3] / "matrices"


def grpo_spec(tmp_path):
    import yaml

    data = yaml.safe_load((MATRICES / "tiny-qwen3-grpo.yaml").read_text())
    data["candidates"]["vocab_tile"] = 64
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(data))
    m = load_matrix(path)
    case = next(c for c in m.cases() if c.dp == 2)
    kw = {k: tmp_path for k in ("model_dir", "rollout_dir", "targets_dir", "case_dir")}
    return make_spec(m.case_settings, case, rollout_digest="r", targets_digest="t", vocab_size=512, device="cpu", **kw)


def test_every_shared_field_comes_from_the_spec(tmp_path):
    spec = grpo_spec(tmp_path)
    ctx = engine_context(spec, 1, tmp_path / "work")
    paths = {"model_dir", "rollout_dir"}  # str in the spec (JSON), Path in the context
    shared = ({f.name for f in dataclasses.fields(EngineContext)} & {f.name for f in dataclasses.fields(spec)}) - paths
    assert shared >= {"role", "precision", "tp", "dp", "device", "optimizer", "temperature", "vocab_size",
                      "logprob_formula", "top_k", "top_p", "min_p", "vocab_tile", "logprob_chunk_tokens"}
    assert {n: getattr(ctx, n) for n in shared} == {n: getattr(spec, n) for n in shared}
    assert (ctx.rank, ctx.work_dir, ctx.model_dir) == (1, tmp_path / "work", Path(spec.model_dir))
    assert ctx.rollout_dir == Path(spec.rollout_dir)
    assert ctx.dp == 2 and ctx.vocab_tile == 64


def test_a_run_on_the_cases_tp_ranks_alone_overrides_dp_only(tmp_path):
    spec = grpo_spec(tmp_path)
    one = engine_context(spec, 0, tmp_path, dp=1)
    assert one.dp == 1 and dataclasses.replace(one, dp=spec.dp) == engine_context(spec, 0, tmp_path)


def test_diagnose_finds_a_moved_run_and_refuses_a_path_as_a_case(tmp_path):
    """A sealed spec holds the paths of the run directory it was written in; diagnose of the same run moved elsewhere
    reads it with them moved (checkpoints outside the run stay), and --case is a name, never a path."""
    from qualify.diagnose.stage import case_spec, moved_to, safe_name
    from qualify.errors import QualifyError
    from qualify.layout import RunLayout

    m = load_matrix(MATRICES / "tiny-qwen3.yaml")
    old = tmp_path / "old" / "run"
    spec = make_spec(m.case_settings, m.cases()[0], model_dir=old / "reference" / "models" / "actor",
                     rollout_dir=old / "reference" / "rollout" / "tp1", targets_dir=Path("/ckpt/targets"),
                     case_dir=old / "candidates" / m.cases()[0].name, rollout_digest="r", targets_digest="t",
                     vocab_size=512, device="cpu")
    new = RunLayout(tmp_path / "new" / "run")
    moved = moved_to(spec, new)
    assert moved.model_dir == str(new.models / "actor") and moved.rollout_dir == str(new.rollout(1))
    assert moved.case_dir == str(new.case(m.cases()[0].name)) and moved.targets_dir == "/ckpt/targets"
    assert safe_name("torch-tp-fp32-tp1-actor") and safe_name("pkg.mod:make-fp32-tp1-actor")
    assert not any(safe_name(n) for n in ("a/../b", "..", ".", "../x", "a\\\\b", ""))
    with pytest.raises(QualifyError, match="is not a case name"):
        case_spec(new, "a/../b")
