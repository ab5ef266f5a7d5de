"""The shipped data-parallel matrix (matrices/tiny-qwen3-dp.yaml): PPO actor and critic of every DP engine at TP1xDP2
and TP2xDP2 beside DP1, on the embedded default's frozen sections (so a run frozen from tiny-qwen3.yaml judges its
cases); a changed frozen field is told apart (negative control)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

from qualify.acceptance import frozen_field_differences
from qualify.matrix import load_matrix
from qualify.schema import to_dict

MATRICES = Path(__file__).resolve().parents[2] / "matrices"
DP_ENGINES = {"torch-tp", "fsdp2", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3", "megatron",
              "megatron-distopt"}


def test_the_dp_matrix_runs_every_dp_engine_at_tp1xdp2_and_tp2xdp2_for_both_roles():
    m = load_matrix(MATRICES / "tiny-qwen3-dp.yaml")
    assert m.algorithm == "ppo" and set(m.candidates.engines) == DP_ENGINES
    layouts = {(c.engine, c.precision, c.role): set() for c in m.cases()}
    for c in m.cases():
        layouts[(c.engine, c.precision, c.role)].add((c.tp, c.dp))
    assert len(layouts) == len(DP_ENGINES) * 2 * 2
    assert all(v == {(1, 1), (1, 2), (2, 1), (2, 2)} for v in layouts.values()), layouts
    assert "deepspeed-zero3-bf16-tp2-dp2-critic" in {c.name for c in m.cases()}
    # '[!m]*' (its comment's advice without a GPU) keeps every engine but Megatron's
    kept = {c.engine for c in m.cases() if fnmatch.fnmatch(c.name, "[!m]*")}
    assert kept == DP_ENGINES - {"megatron", "megatron-distopt"}


def test_its_frozen_sections_are_the_embedded_defaults():
    tiny = to_dict(load_matrix(MATRICES / "tiny-qwen3.yaml"))
    dp = to_dict(load_matrix(MATRICES / "tiny-qwen3-dp.yaml"))
    assert frozen_field_differences(tiny, dp) == []
    changed = to_dict(load_matrix(MATRICES / "tiny-qwen3-dp.yaml"))
    changed["ppo"]["clip_eps"] = 0.3
    assert frozen_field_differences(tiny, changed) == ["ppo.clip_eps: 0.2 (frozen) != 0.3"]
