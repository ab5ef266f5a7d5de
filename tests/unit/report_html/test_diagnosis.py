"""The HTML report's layer diagnosis section: plotted only for verified evidence and this acceptance's diagnoses."""

from __future__ import annotations

from qualify.report_html.diagnosis import diagnosis_sections, layer_plot
from qualify.store import write_json


def diagnosis(case: str, digest: str, first: dict | None) -> dict:
    layers = [{"layer": "embedding", "forward": None, "backward": 0.0}, {"layer": "0", "forward": 0.0, "backward": 3.0},
              {"layer": "1", "forward": 40.0, "backward": 2.0}, {"layer": "final norm", "forward": 9.0, "backward": None}]
    return {"schema": "qualify.diagnosis/1", "case": case, "acceptance_digest": digest, "first_departure": first,
            "families": {"fp32-repeat": {"reference_run": "fp32-r0", "layers": layers}}}


FIRST = {"layer": "1", "key": "act/model.layers.1.self_attn", "phase": "forward", "metric": "max_abs", "value": 0.4,
         "bound": 0.01, "family": "fp32-repeat"}


def test_layer_plot_is_inline_svg():
    svg = layer_plot(diagnosis("c", "d", FIRST))
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert layer_plot(diagnosis("c", "d", FIRST)) == svg  # reproducible bytes


def test_sections_only_for_verified_evidence_and_this_acceptance(tmp_path):
    assert diagnosis_sections(tmp_path, "sha256:a", True) == []  # no diagnosis in the run: no section
    write_json(tmp_path / "diagnose" / "bad.json", diagnosis("bad", "sha256:a", FIRST))
    write_json(tmp_path / "diagnose" / "good.json", diagnosis("good", "sha256:a", None))
    write_json(tmp_path / "diagnose" / "old.json", diagnosis("old", "sha256:old", None))
    (html,) = diagnosis_sections(tmp_path, "sha256:a", True)
    assert 'data-case="bad"' in html and "first out of bound: layer 1, act/model.layers.1.self_attn" in html
    assert 'data-case="good"' in html and "every layer within bound" in html
    assert 'data-case="old"' not in html and "another acceptance" in html and "sha256:old" in html
    (unverified,) = diagnosis_sections(tmp_path, "sha256:a", False)
    assert "not shown" in unverified and "<svg" not in unverified


def test_a_case_name_from_a_diagnosis_file_is_escaped_everywhere_it_lands(tmp_path):
    """diagnose/<case>.json is a file anyone can drop into a run: its case name reaches an id attribute, a data
    attribute and a heading, never as markup (a script there ran under a PASS banner)."""
    evil = 'x"><script>alert(1)</script><p id="y'
    write_json(tmp_path / "diagnose" / "evil.json", diagnosis(evil, "sha256:a", FIRST))
    (html,) = diagnosis_sections(tmp_path, "sha256:a", True)
    assert "<script>" not in html and 'id="diagnosis-x&quot;&gt;&lt;script&gt;' in html
