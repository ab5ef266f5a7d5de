"""matrices/tiny-qwen3-pad.yaml end to end: its rollout (real vLLM at TP1 and TP2) ends some responses early, so the
padded_rows branch its freeze.require names is taken and freeze accepts the reference; a TP2 case of each engine
then passes against it. A shipped matrix must run."""

from __future__ import annotations

from pathlib import Path

import pytest

from qualify.candidate.stage import run_candidates
from qualify.freeze import freeze
from qualify.layout import RunLayout
from qualify.matrix import load_matrix
from qualify.rollout.capture import load_rollout
from qualify.store import read_json
from tests.integration._support import plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.engines, pytest.mark.slow]
PAD = Path(__file__).resolve().parents[2] / "matrices" / "tiny-qwen3-pad.yaml"


def test_the_pad_matrix_pads_rows_freezes_and_judges(tmp_path):
    from qualify.reference.stage import run_reference

    matrix = load_matrix(PAD)
    run = tmp_path / "tiny-qwen3-pad"
    run_reference(matrix, run)
    layout = RunLayout(run)
    for tp in matrix.rollout.vllm_tp:
        rollout = load_rollout(layout.rollout(tp))
        lengths = rollout["response_mask_BT"].sum(1)
        ended = (lengths < matrix.rollout.max_new_tokens).nonzero().flatten().tolist()
        assert ended, f"vLLM TP{tp}: every response ran to max_new_tokens"
        for row in ended:  # each early end is the EOS, sampled as the last response token
            last = int(rollout["response_mask_BT"][row].nonzero().max())
            assert int(rollout["input_ids_BT"][row, last]) == matrix.rollout.eos_token_id
    freeze(run)
    doc = read_json(layout.acceptance)
    assert "padded_rows" in doc["coverage"]["required"]
    assert any(step["padded_rows"] for steps in doc["coverage"]["steps"].values() for step in steps)
    verdict = run_candidates(matrix, run, only="*-fp32-tp2-critic")
    assert verdict.passed, [(r.case, r.tensor, r.metric, r.value, r.bound) for r in verdict.rows if not r.passed][:5]
    assert sorted(verdict.cases) == ["deepspeed-fp32-tp2-critic", "torch-tp-fp32-tp2-critic"]
