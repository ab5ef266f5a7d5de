"""A complete case is redone when the engine's code changed since it was sealed (never an old PASS reused)."""

from __future__ import annotations

import os
import sys

import pytest

from qualify.candidate.run import run_candidates
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
