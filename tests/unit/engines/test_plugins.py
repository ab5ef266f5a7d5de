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
    ("broken_pkg.engine:make", "engine module 'broken_pkg.engine': RuntimeError: boom at import"),
    ("os:system", "not a function or class defined in Python source"),  # os is frozen (3.11) or os.py
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


NOT_PYTHON = ["os:system", "builtins:eval", "builtins:exit", "builtins:input", "os:abort"]


@pytest.mark.parametrize("name", NOT_PYTHON)
def test_a_factory_that_is_not_python_source_is_refused_in_one_line(name):
    """A builtin or C function named as a factory is refused before anything calls it (os:abort would kill the rank,
    builtins:input wait on stdin, builtins:exit raise SystemExit) and before its source is hashed for the resume key
    (it was FileNotFoundError: 'built-in')."""
    from qualify.engines.registry import require_engine

    for check in (require_engine, engine_identity, get_engine):
        with pytest.raises(EngineError) as caught:
            check(name)
        message = str(caught.value)
        assert f"engine plugin '{name}'" in message and "not a function or class defined in Python source" in message
        assert "\n" not in message


def test_a_python_module_that_binds_its_factory_otherwise_is_checked_when_made(tmp_path, monkeypatch):
    """A factory bound by assignment or import is read in the module's source, and checked when the engine is made:
    a builtin bound to a Python name is refused there too; a function or class defined in Python is a factory."""
    from qualify.engines.registry import require_engine

    (tmp_path / "bound_engines.py").write_text(
        "import functools\nfrom os import abort as aborts\n\nprints = print\nlater = functools.partial(print)\n\n"
        "if True:\n    class Made:\n        pass\n\n\ndef make():\n    return Made()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for name in ("bound_engines:aborts", "bound_engines:prints", "bound_engines:later", "bound_engines:Made",
                     "bound_engines:make"):
            require_engine(name)  # bound at the module's top level
        for name in ("bound_engines:aborts", "bound_engines:prints", "bound_engines:later"):
            with pytest.raises(EngineError, match="not a function or class defined in Python source"):
                get_engine(name)
        with pytest.raises(EngineError, match="which lacks setup"):  # a Python class: made, then found wanting
            get_engine("bound_engines:Made")
        with pytest.raises(EngineError, match="bound_engines.py does not bind 'missing'"):
            require_engine("bound_engines:missing")
    finally:
        sys.modules.pop("bound_engines", None)


@pytest.mark.parametrize("name", NOT_PYTHON)
def test_the_candidate_stage_refuses_it_before_anything_else(name, tmp_path):
    """`qualify candidate` with such an engine: one line, exit 2, before the acceptance is read or any rank starts."""
    import yaml
    from typer.testing import CliRunner

    from qualify.cli.app import app
    from tests.conftest import TINY

    data = yaml.safe_load(TINY.read_text())
    data["candidates"]["engines"] = [name]
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["candidate", str(matrix), "--run", str(tmp_path / "run")])
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert f"engine plugin '{name}'" in result.stderr and "not a function or class" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
