"""A complete case is redone when the engine's code changed since it was sealed (never an old PASS reused)."""

from __future__ import annotations

import os
import sys

import pytest

from qualify.candidate.stage import run_candidates
from tests.integration._support import matrix_with, plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.engines]
GOOD = "from qualify.engines.torch_tp import TorchTPEngine\n\n\ndef engine():\n    return TorchTPEngine()\n"
BROKEN = GOOD.replace("return TorchTPEngine()", "from tests.integration.plugins import NanGradient\n"
                                                "    return NanGradient()")


def test_changed_plugin_code_redoes_the_case(run_copy, tmp_path, monkeypatch, capsys):
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir()
    (plugin_dir / "team_engine.py").write_text(GOOD)
    monkeypatch.syspath_prepend(str(plugin_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(plugin_dir), os.environ["PYTHONPATH"]]))
    m = matrix_with(run_copy.parent, engines=["team_engine:engine"], precisions=["fp32"], tp=[1], roles=["actor"])
    assert run_candidates(m, run_copy).to_json()["passed"]
    assert run_candidates(m, run_copy).to_json()["passed"]  # unchanged: reused
    assert "complete, skipped" in capsys.readouterr().err
    (plugin_dir / "team_engine.py").write_text(BROKEN)
    sys.modules.pop("team_engine", None)
    verdict = run_candidates(m, run_copy).to_json()
    # the plugin's own file is in the key before launch, and among the files its ranks imported
    assert "engine code, imported code changed since it was sealed" in capsys.readouterr().err
    assert not verdict["passed"]


PEER = "CLIP_SCALE = 1.0\n\n\ndef clip_range(eps):\n    return CLIP_SCALE * eps\n"
TEAM = ("from peerlib.losses import clip_range\nfrom qualify.examples.own_objective import OwnObjectiveEngine\n\n\n"
        "class Team(OwnObjectiveEngine):\n    def policy_clip(self, ppo):\n        return clip_range(ppo.clip_eps)\n\n\n"
        "def engine():\n    return Team()\n")


def test_a_changed_peer_library_redoes_the_case(run_copy, tmp_path, monkeypatch, capsys):
    """The plugin's own file is unchanged; the peer library whose loss code it calls (its own package, installed
    apart from the plugin) changes its clip range: the case is redone and fails, never reused as PASS."""
    site, plugin_dir = tmp_path / "site", tmp_path / "plugin"
    (site / "peerlib").mkdir(parents=True)
    plugin_dir.mkdir()
    (site / "peerlib" / "__init__.py").write_text("")
    (site / "peerlib" / "losses.py").write_text(PEER)
    (plugin_dir / "team_trainer.py").write_text(TEAM)
    for where in (site, plugin_dir):
        monkeypatch.syspath_prepend(str(where))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(plugin_dir), str(site), os.environ["PYTHONPATH"]]))
    m = matrix_with(run_copy.parent, engines=["team_trainer:engine"], precisions=["fp32"], tp=[1], roles=["actor"])
    assert run_candidates(m, run_copy).to_json()["passed"]
    (site / "peerlib" / "losses.py").write_text(PEER.replace("1.0", "1.5"))
    for name in ("peerlib", "peerlib.losses", "team_trainer"):
        sys.modules.pop(name, None)
    verdict = run_candidates(m, run_copy).to_json()
    err = capsys.readouterr().err
    assert "imported code changed since it was sealed" in err and "complete, skipped" not in err.split("redo")[-1]
    assert not verdict["passed"]


def test_judged_rows_are_reused_only_on_the_same_evidence_and_report_judges_again(run_copy, tmp_path, capsys):
    """A case judged once keeps its rows beside its evidence (qualify.judge.judged): the next candidate stage on
    the same sealed evidence reuses them instead of judging again. Rows kept under another key are judged again, and
    rows forged in the kept file (the key left as it was) pass into the candidate's verdict but not past `qualify
    report`, which judges every case again from its evidence."""
    from qualify.case.meta import read_case_meta
    from qualify.judge.judged import judged_path
    from qualify.layout import RunLayout
    from qualify.report import load_docs
    from qualify.report_verify import verify_run
    from qualify.store import dumps_json, read_json, write_json

    m = matrix_with(run_copy.parent, engines=["torch-tp"], precisions=["fp32"], tp=[1], roles=["actor"])
    first = run_candidates(m, run_copy).to_json()
    [case] = first["cases"]
    kept = judged_path(RunLayout(run_copy).case(case))
    doc = read_json(kept)
    assert first["passed"] and doc["rows"] == [r for r in first["rows"] if r["case"] == case]
    meta = RunLayout(run_copy).case(case) / "meta.json"  # the worker's real meta.json reads back byte for byte
    assert dumps_json(read_case_meta(meta.parent).to_json()).encode("ascii") == meta.read_bytes()
    capsys.readouterr()

    again = run_candidates(m, run_copy).to_json()
    err = capsys.readouterr().err
    assert f"judge {case}: {len(doc['rows'])} rows judged before on the same evidence" in err
    assert again["rows"] == first["rows"]

    write_json(kept, doc | {"key": "sha256:" + "0" * 64})  # rows kept by other code or on other evidence
    assert run_candidates(m, run_copy).to_json()["rows"] == first["rows"]
    err = capsys.readouterr().err
    assert "judged before" not in err and f"judge {case}" in err

    forged = read_json(kept)
    row = next(r for r in forged["rows"] if r["metric"] == "max_abs" and r["tensor"].startswith("step0/grads/"))
    row["value"] = row["value"] / 2 + 1e-30
    write_json(kept, forged)
    verdict = run_candidates(m, run_copy).to_json()
    assert any(r["value"] == row["value"] for r in verdict["rows"])  # the stage trusts its own kept rows...
    docs = load_docs(run_copy)
    problems = verify_run(docs.layout, docs.reference, docs.acceptance, docs.verdict, docs.rounds).problems
    assert any(case in p and row["tensor"] in p for p in problems), problems  # ...report does not
