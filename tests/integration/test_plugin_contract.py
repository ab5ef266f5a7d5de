"""A plugin that breaks the engine contract gets a verdict, not a traceback: its case stops before anything is
sealed, its one row fails with a one-line note (the plugin, the hook, what was expected and what came back, the
launch log's path), and the console shows that note whole. The GRPO form (a PPO objective() under GRPO) is in
test_grpo_chain.py; a factory that asks for an argument (contract_plugins.needs_config) is refused before any rank
starts (tests/unit/test_engine_plugins.py)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from qualify.candidate.stage import run_candidates
from qualify.cli.verdict_view import render_verdict
from qualify.layout import RunLayout
from qualify.stages import stage_is_complete
from tests.integration._support import matrix_with, plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.engines]
P = "tests.integration.contract_plugins"
MISTAKES = {  # factory -> what the note must say
    "no_grad_dtypes": "lacks grad_dtypes",
    "per_row_loss": "objective() returned as loss a tensor of shape (",
    "short_ratio": "objective()'s output ratio_BT is a tensor of shape (",
}


def test_each_contract_mistake_is_a_one_line_failing_row_and_nothing_is_sealed(run_copy):
    m = matrix_with(run_copy.parent, engines=[f"{P}:{name}" for name in MISTAKES], precisions=["fp32"], tp=[1],
                    roles=["actor"])
    verdict = run_candidates(m, run_copy).to_json()
    assert not verdict["passed"] and verdict["complete"]
    for case, (name, says) in zip((c.name for c in m.cases()), MISTAKES.items(), strict=True):
        [row] = [r for r in verdict["rows"] if r["case"] == case]
        assert (row["comparison"], row["passed"]) == ("run", False), row
        note = row["note"]
        assert "\n" not in note and says in note and f"{P}:{name}" in note, note
        assert note.endswith("launch.log") and "; log " in note, note
        assert not stage_is_complete(RunLayout(run_copy).case(case)), f"{case} sealed after a crash"
    out = io.StringIO()
    render_verdict(verdict, Console(file=out, width=400, highlight=False))
    shown = out.getvalue()
    for says in MISTAKES.values():
        assert says in shown, shown
