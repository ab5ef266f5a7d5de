"""`qualify report` states what the run's evidence weighs: the reference's sizes as its stage recorded them and each
case's bytes on disk, measured when the report is made."""

from __future__ import annotations

from qualify.layout import RunLayout
from qualify.reference.mismatch_text import evidence_line
from qualify.report import RunDocs, evidence_summary

REFERENCE = {"reference_bytes": 47_687_554_676, "full_runs": 4, "full_runs_bytes": 38_148_665_335, "summaries": 4,
             "summaries_bytes": 1_657_472, "replays_bytes": 0, "mode": "summary", "bytes_per_parameter_step": 16.0}


def test_each_case_is_measured_on_disk_and_the_reference_as_recorded(tmp_path):
    layout = RunLayout(tmp_path)
    for name, sizes in (("a-case", [100, 23]), ("b-case", [7])):
        for i, size in enumerate(sizes):
            path = layout.case(name) / f"step{i}" / "grads.safetensors"
            path.parent.mkdir(parents=True)
            path.write_bytes(b"x" * size)
    case = {"passed": True, "num_checks": 1, "num_failed": 0}
    verdict = {"passed": True, "rows": [], "cases": {"a-case": case, "b-case": case, "c-never-ran": case}}
    docs = RunDocs(layout, {"evidence": REFERENCE}, None, verdict, {})
    assert evidence_summary(docs) == {"reference": REFERENCE, "cases": {"a-case": 123, "b-case": 7, "c-never-ran": 0},
                                      "cases_bytes_per_parameter_step": {"a-case": None, "b-case": None,
                                                                         "c-never-ran": None}}
    unreadable = RunDocs(layout, {}, None, "not a verdict", {})
    assert evidence_summary(unreadable) == {"reference": None, "cases": {}, "cases_bytes_per_parameter_step": {}}


def test_a_cases_bytes_per_parameter_step_counts_its_tensors_not_its_outputs(tmp_path):
    """16 bytes a parameter a step for plain fp32 gradients, updates and moments; fewer when coded."""
    import torch

    from qualify.compare import write_step
    from qualify.report import bytes_per_parameter_step

    step = {"outputs": {"loss": torch.zeros(40000)}, "grads": {"w": torch.randn(20000)}, "updates": {"w": torch.randn(20000)},
            "moments": {"exp_avg/w": torch.randn(20000), "exp_avg_sq/w": torch.rand(20000)}}
    for k in range(2):
        write_step(tmp_path / "plain" / f"step{k}", step)
    assert 16 < bytes_per_parameter_step(tmp_path / "plain") < 16.5  # and the files' headers
    bf16 = step | {"grads": {"w": torch.randn(20000).bfloat16().float()}}
    write_step(tmp_path / "coded" / "step0", bf16)
    assert 14 < bytes_per_parameter_step(tmp_path / "coded") < 14.6


def test_the_evidence_line_names_mode_sizes_and_bytes_per_parameter():
    line = evidence_line(REFERENCE)
    assert line.strip() == ("evidence (summary): 47687.6 MB; 4 run(s) kept in full 38148.7 MB (16 bytes per parameter "
                            "per step), 4 control(s) kept as summaries 1.7 MB, replays 0.0 MB")
