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
    assert evidence_summary(docs) == {"reference": REFERENCE, "cases": {"a-case": 123, "b-case": 7, "c-never-ran": 0}}
    unreadable = RunDocs(layout, {}, None, "not a verdict", {})
    assert evidence_summary(unreadable) == {"reference": None, "cases": {}}


def test_the_evidence_line_names_mode_sizes_and_bytes_per_parameter():
    line = evidence_line(REFERENCE)
    assert line.strip() == ("evidence (summary): 47687.6 MB; 4 run(s) kept in full 38148.7 MB (16 bytes per parameter "
                            "per step), 4 control(s) kept as summaries 1.7 MB, replays 0.0 MB")
