"""A plugin engine that cannot be made is a one-line EngineError naming the plugin and what went wrong, never a
traceback: a module (or its package) whose import raises, a factory that takes arguments or raises, a factory that
returns something that is not a TrainEngine. What the module's source settles is refused before anything imports it
(qualify.engines.plugin_source); a correct plugin of every shape, and one whose source leaves the question open, is
not."""

from __future__ import annotations

import sys

import pytest

from qualify.engines.registry import ENGINE_METHODS, engine_identity, get_engine
from qualify.errors import EngineError


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    (tmp_path / "broken_pkg").mkdir()
    (tmp_path / "broken_pkg" / "__init__.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "broken_pkg" / "engine.py").write_text("def make():\n    return None\n")
    (tmp_path / "half_engine.py").write_text(  # mistakes the source does not settle: only making the engine finds them
        "class Half:\n    def setup(self, ctx):\n        pass\n\n\ndef make():\n    half = Half()\n    return half\n\n\n"
        "def needs(*args):\n    return args[0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("broken_pkg", "broken_pkg.engine", "half_engine"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("name, expect", [
    ("broken_pkg.engine:make", "engine module 'broken_pkg.engine': RuntimeError: boom at import"),
    ("os:system", "not a function or class defined in Python source"),  # os is frozen (3.11) or os.py
    ("half_engine:needs", "engine plugin 'half_engine:needs': calling needs() failed: IndexError"),
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


METHODS = "".join(f"    def {m}(self, *args):\n        return None\n\n" for m in ENGINE_METHODS)
"""The body of a class that has every TrainEngine method."""


def write_plugin(tmp_path, monkeypatch, module: str, source: str) -> None:
    """module.py holding source, on sys.path (nothing imports it: require_engine reads it)."""
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


REFUSED_BY_SOURCE = [  # (source, factory, what the one line says)
    ("def make(config):\n    return None\n", "make", "def make(config) asks for config; the factory takes no argument"),
    ("def make(dtype='bf16', *, device):\n    return None\n", "make", "def make(dtype='bf16', *, device) asks for device"),
    ("from qualify.engines.base import TrainEngine\n\n\nclass Engine(TrainEngine):\n"
     "    def __init__(self, model_dir, tp=1):\n        self.model_dir = model_dir\n\n" + METHODS, "Engine",
     "class Engine's __init__(self, model_dir, tp=1) asks for model_dir; the factory takes no argument"),
    ("class Base:\n    def __init__(self, ckpt):\n        pass\n\n\nclass Engine(Base):\n" + METHODS, "Engine",
     "class Engine's __init__(self, ckpt) (class Base's) asks for ckpt"),
    (("from qualify.engines.base import OutputScoring as Scoring\n\n\nclass Engine(Scoring):\n    packed = True\n\n"
     "    def setup(self, ctx):\n        pass\n"), "Engine", ("class Engine lacks score, backward, grads, grad_dtypes, "
     "step, params, optimizer_state, replicated, padded_rows, close of qualify.engines.base.TrainEngine")),
    (("class Half(object):\n    def setup(self, ctx):\n        pass\n\n\ndef make():\n    if True:\n        return Half()\n"
     "    return Half(1)\n"), "make", "class Half (what make() returns) lacks score, backward"),
]


@pytest.mark.parametrize("source, factory, expect", REFUSED_BY_SOURCE)
def test_what_the_source_settles_is_refused_before_any_import(source, factory, expect, tmp_path, monkeypatch):
    """A factory that asks for arguments, or makes a class that lacks a TrainEngine method, as the module's source
    settles it: refused in one line naming the plugin and the file, the module never imported."""
    from qualify.engines.registry import require_engine

    write_plugin(tmp_path, monkeypatch, "settled_plugin", source + "\nraise RuntimeError('imported')\n")
    with pytest.raises(EngineError) as caught:
        require_engine(f"settled_plugin:{factory}")
    message = str(caught.value)
    assert message.startswith(f"engine plugin 'settled_plugin:{factory}': {tmp_path / 'settled_plugin.py'}: ")
    assert expect in message and "\n" not in message and "settled_plugin" not in sys.modules


CORRECT_OR_OPEN = {  # plugins whose source shows nothing wrong, or leaves it open: left to the ranks
    "def factory": f"class Engine:\n{METHODS}\n\ndef make(dtype='bf16', *args, **kwargs):\n    return Engine()\n",
    "class factory": f"class make:\n    def __init__(self, dtype='bf16', *, tp=1):\n        pass\n\n{METHODS}",
    "qualify's bases": "from qualify.engines.base import OutputScoring, TrainEngine\n\n\n"
                       "class make(OutputScoring, TrainEngine):\n    packed = True\n",
    "an imported base": "from somewhere import Base\n\n\nclass make(Base):\n    def __init__(self, cfg):\n        pass\n",
    "an attribute base": "import qualify.engines.base as b\n\n\nclass make(b.OutputScoring):\n    pass\n",
    "a decorator": "import dataclasses\n\n\n@dataclasses.dataclass\nclass make:\n    cfg: int\n",
    "a metaclass": "class Meta(type):\n    pass\n\n\nclass make(metaclass=Meta):\n    def __init__(self, cfg):\n"
                   "        pass\n",
    "methods set on the instance": "class make:\n    def __init__(self):\n        self."
                                   + " = self.".join(ENGINE_METHODS) + " = print\n",
    "methods set by name": f"class make:\n    def __init__(self):\n        for m in {ENGINE_METHODS!r}:\n"
                           "            setattr(self, m, print)\n",
    "a factory rebound": "import functools\n\n\ndef make(cfg):\n    return cfg\n\n\nmake = functools.partial(make, 1)\n",
    "a factory bound in a block": "try:\n    def make(cfg):\n        return cfg\nexcept ImportError:\n    pass\n",
    "a def returning two classes": "class A:\n    pass\n\n\nclass B:\n    pass\n\n\ndef make():\n"
                                   "    return A() if True else B()\n",
    "a shadowed class": "class Half:\n    pass\n\n\ndef make():\n    from elsewhere import Engine as Half\n"
                        "    return Half()\n",
    "the class handed out": "from hooks import register\n\n\nclass make:\n    pass\n\n\nregister(make)\n",
    "the instance handed out": "from hooks import install\n\n\nclass make:\n    def __init__(self):\n"
                               "        install(self)\n",
    "sys.modules rewritten": "import sys\n\n\ndef make(cfg):\n    return cfg\n\n\nsys.modules[__name__] = None\n",
    "a star import": "class Half:\n    pass\n\n\ndef make():\n    return Half()\n\n\nfrom elsewhere import *\n",
}


@pytest.mark.parametrize("shape", sorted(CORRECT_OR_OPEN))
def test_a_plugin_whose_source_shows_nothing_wrong_is_not_refused(shape, tmp_path, monkeypatch):
    from qualify.engines.registry import require_engine

    write_plugin(tmp_path, monkeypatch, "open_plugin", CORRECT_OR_OPEN[shape])
    require_engine("open_plugin:make")


STAGE_REFUSES = [  # (plugin source, ppo settings, what the one line says)
    ("def make(config):\n    return None\n", {}, "def make(config) asks for config"),
    (f"class Engine:\n{METHODS}\n\ndef make():\n    return Engine()\n", {"entropy_coef": 0.01},
     ("ppo.entropy_coef 0.01 needs the entropy of the policy from the forward score() ran, and class Engine has no "
     "entropy() hook")),
]


@pytest.mark.parametrize("source, ppo, expect", STAGE_REFUSES)
def test_the_candidate_stage_refuses_what_the_source_settles(source, ppo, expect, tmp_path, monkeypatch):
    """`qualify candidate` with a plugin whose def factory asks for an argument, or whose class has no entropy() for
    the matrix's entropy bonus: one line, exit 2, before the acceptance is read or any rank starts."""
    import yaml
    from typer.testing import CliRunner

    from qualify.cli.app import app
    from tests.conftest import TINY

    write_plugin(tmp_path, monkeypatch, "argued_plugin", source)
    data = yaml.safe_load(TINY.read_text())
    data["candidates"]["engines"] = ["argued_plugin:make"]
    data["ppo"] |= ppo
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["candidate", str(matrix), "--run", str(tmp_path / "run")])
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert "engine plugin 'argued_plugin:make': " in result.stderr and expect in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_the_integration_factory_that_asks_for_a_config_is_refused_before_any_rank():
    """tests/integration/contract_plugins.needs_config (once a failing row of the contract run) is refused from its
    source."""
    from qualify.engines.registry import require_engine

    with pytest.raises(EngineError, match=r"def needs_config\(config: dict\) asks for config; the factory takes no"):
        require_engine("tests.integration.contract_plugins:needs_config")
