"""A complete case is reused only when what it was made with is unchanged: spec, engine code, versions, acceptance."""

from __future__ import annotations

import sys

import pytest

from qualify.candidate.run import resume_key, stale_reason
from qualify.candidate.spec import make_spec
from qualify.engines.registry import engine_identity
from qualify.errors import EngineError
from qualify.matrix import load_matrix
from qualify.stages import complete_stage, prepare_stage
from tests.conftest import TINY

PLUGIN = "class E:\n    name = 'e'\n\n\ndef make():\n    return E()\n"


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_engine.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "my_engine.py"
    sys.modules.pop("my_engine", None)


def test_plugin_identity_follows_its_source(plugin):
    before = engine_identity("my_engine:make")
    assert any(k.startswith("my_engine:") for k in before["sources"]) and before["factory"] == "make"
    plugin.write_text(PLUGIN.replace("'e'", "'e2'"))
    assert engine_identity("my_engine:make") != before


def test_builtin_identity_covers_the_adapters_and_the_harness():
    sources = engine_identity("torch-tp")["sources"]
    assert "qualify.engines:torch_tp.py" in sources and "qualify.engines:megatron_convert.py" in sources
    assert "qualify.candidate.worker:worker.py" in sources and "qualify.ppo.objective:objective.py" in sources


def test_unknown_engine_has_no_identity():
    with pytest.raises(EngineError, match="unknown engine"):
        engine_identity("no-such-engine")


def test_stale_reason_names_what_changed(tmp_path, plugin):
    matrix = load_matrix(TINY)
    case = matrix.cases()[0]
    spec = make_spec(matrix, case, model_dir=tmp_path, rollout_dir=tmp_path, targets_dir=tmp_path,
                     rollout_digest="r", targets_digest="t", case_dir=tmp_path / "case", vocab_size=512, device="cpu")
    key = resume_key(spec, {"digest": "sha256:a"})
    prepare_stage(tmp_path / "case")
    complete_stage(tmp_path / "case", {"key": key})
    assert stale_reason(tmp_path / "case", key) is None
    assert stale_reason(tmp_path / "case", key | {"acceptance": "sha256:b"}) == "acceptance changed since it was sealed"
    other = resume_key(spec.__class__(**{**{f: getattr(spec, f) for f in spec.__slots__}, "engine": "my_engine:make"}),
                       {"digest": "sha256:a"})
    assert stale_reason(tmp_path / "case", other) == "spec, engine code changed since it was sealed"
    complete_stage(tmp_path / "case", {})  # sealed by an older qualify: no key at all
    assert "spec" in stale_reason(tmp_path / "case", key)
