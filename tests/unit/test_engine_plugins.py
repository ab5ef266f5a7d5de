"""A plugin engine that cannot be made is a one-line EngineError naming the plugin and what went wrong, never a
traceback: a module (or its package) whose import raises, a factory that takes arguments or raises, a factory that
returns something that is not a TrainEngine."""

from __future__ import annotations

import sys

import pytest

from qualify.engines.registry import engine_identity, get_engine
from qualify.errors import EngineError


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    (tmp_path / "broken_pkg").mkdir()
    (tmp_path / "broken_pkg" / "__init__.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "broken_pkg" / "engine.py").write_text("def make():\n    return None\n")
    (tmp_path / "half_engine.py").write_text("class Half:\n    def setup(self, ctx):\n        pass\n\n\n"
                                             "def make():\n    return Half()\n\n\ndef needs(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("broken_pkg", "broken_pkg.engine", "half_engine"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("name, expect", [
    ("broken_pkg.engine:make", "cannot import engine plugin module 'broken_pkg.engine': RuntimeError: boom at import"),
    ("os:system", "engine plugin 'os:system': calling system() failed: TypeError"),
    ("half_engine:needs", "engine plugin 'half_engine:needs': calling needs() failed: TypeError"),
    ("half_engine:make", "engine plugin 'half_engine:make': make() returned a Half, which lacks score, backward, grads"),
])
def test_a_plugin_that_cannot_be_made_is_named(plugins, name, expect):
    with pytest.raises(EngineError) as caught:
        get_engine(name)
    assert expect in str(caught.value) and "\n" not in str(caught.value)


def test_the_resume_key_of_a_package_whose_init_raises_is_an_engine_error(plugins):
    with pytest.raises(EngineError, match="cannot find the source of engine module 'broken_pkg.engine': RuntimeError"):
        engine_identity("broken_pkg.engine:make")


def test_a_builtin_engine_is_made():
    assert type(get_engine("torch-tp")).__name__ == "TorchTPEngine"
