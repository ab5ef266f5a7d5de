"""The text report shows per-step checks and the coverage the acceptance froze."""

from __future__ import annotations

from qualify.report import coverage_lines, steps_summary


def test_steps_summary_counts_checks_and_failures_per_step_in_order():
    rows = [{"tensor": "step10/grads/w", "passed": True}, {"tensor": "step2/outputs/loss", "passed": False},
            {"tensor": "step2/grads/w", "passed": True}, {"tensor": "evidence/replicas", "passed": False}]
    assert steps_summary({"rows": rows}) == {"step2": {"checks": 2, "failed": 1}, "step10": {"checks": 1, "failed": 0}}
    assert steps_summary(None) == {} and steps_summary(["not", "a", "verdict"]) == {}


def test_coverage_lines_has_a_row_per_role_and_step():
    coverage = {"required": ["value_clip"], "steps": {"critic": [{"value_clip": 0, "adam_step": 1},
                                                                 {"value_clip": 7, "adam_step": 2}]}}
    lines = coverage_lines(coverage)
    assert "required: value_clip" in lines[1]
    assert [line for line in lines if line.startswith("| critic |")] == [
        "| critic | 0 |  |  | 0 |  |  |  | 1 |", "| critic | 1 |  |  | 7 |  |  |  | 2 |"]
    assert coverage_lines(None) == []


def test_report_of_a_reference_summary_without_its_keys_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from qualify.cli.app import app
    from qualify.layout import RunLayout
    from qualify.store import write_json

    for summary, says in (({}, "no 'matrix' key"), ({"matrix": [], "rollout_digest": "x", "tp_agreement": {},
                                                      "rollout_mismatch": {}, "controls": []}, "has no name")):
        write_json(RunLayout(tmp_path).reference_summary, summary)
        result = CliRunner().invoke(app, ["report", str(tmp_path)])
        assert result.exit_code == 2 and says in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_the_false_alarm_margin_is_the_passing_row_closest_to_its_bound():
    from qualify.report import closest_passing

    rows = [{"case": "a", "tensor": "t1", "metric": "max_abs", "value": 3.0, "bound": 4.0, "ratio": 0.75, "passed": True},
            {"case": "b", "tensor": "t2", "metric": "p99_abs", "value": 5.0, "bound": 4.0, "ratio": 1.25, "passed": False},
            {"case": "b", "tensor": "t3", "metric": "mean_abs", "value": 0.0, "bound": 0.0, "ratio": 0.0, "passed": True},
            {"case": "c", "tensor": "t4", "metric": "check", "value": [1], "bound": None, "ratio": 0.0, "passed": True},
            {"case": "c", "tensor": "t5", "metric": "rel_l2", "value": 1.0, "bound": 2.0, "ratio": 0.5, "passed": True}]
    assert closest_passing(rows) == {"case": "a", "tensor": "t1", "metric": "max_abs", "value": 3.0, "bound": 4.0,
                                     "ratio": 0.75}
    assert closest_passing(rows[1:3]) is None  # a failing row and a zero bound are no margin
    # derivation rows (rounding bounds) are their own margin, apart from the bound rows'
    derived = {"case": "d", "tensor": "step0/updates", "metric": "derived_abs", "value": 9.0, "bound": 10.0,
               "ratio": 0.9, "passed": True, "comparison": "derived"}
    assert closest_passing([*rows, derived])["ratio"] == 0.75
    assert closest_passing([*rows, derived], derived=True) == {k: derived[k] for k in
                                                                ("case", "tensor", "metric", "value", "bound", "ratio")}
    assert closest_passing(rows, derived=True) is None
