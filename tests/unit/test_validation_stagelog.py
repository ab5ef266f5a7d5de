"""Stage log lines say what happened: a step whose output was already complete is 'skipped', never 'done in'."""

from __future__ import annotations

from qualify.stagelog import StageLog


def test_a_step_that_runs_is_done(capsys):
    with StageLog("reference").step("score fp32 r0 actor"):
        pass
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[reference] score fp32 r0 actor ..."
    assert err[1].startswith("[reference] score fp32 r0 actor: done in ") and err[1].endswith(" s")


def test_a_step_that_finds_its_output_complete_is_skipped(capsys):
    with StageLog("reference").step("capture rollout: vLLM TP1") as step:
        step.skip()
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("[reference] capture rollout: vLLM TP1: complete, skipped (verified in ")
    assert "done in" not in "\n".join(err)


def test_skip_without_a_step_and_quiet(capsys):
    StageLog("candidate").skip("case torch-tp-fp32-tp1-actor")
    with StageLog("candidate", quiet=True).step("case x") as step:
        step.skip()
    assert capsys.readouterr().err == "[candidate] case torch-tp-fp32-tp1-actor: complete, skipped\n"


def test_a_long_line_is_not_folded(capsys):
    description = "cases " + ", ".join(f"torch-tp-fp32-tp{i}-actor" for i in range(8))
    StageLog("candidate").skip(description)
    assert capsys.readouterr().err == f"[candidate] {description}: complete, skipped\n"
