"""A complete case is reused only when what it was made with is unchanged: spec, engine code, versions, acceptance."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from qualify.candidate.imported import KEY, QUALIFY, imported_files, record
from qualify.candidate.resume import resume_key, stale_reason
from qualify.case.spec import make_spec
from qualify.engines.registry import engine_identity
from qualify.errors import EngineError
from qualify.layout import work_dir
from qualify.matrix import load_matrix
from qualify.stages import complete_stage, prepare_stage
from tests.conftest import TINY

PLUGIN = ("from qualify.engines.torch_tp import TorchTPEngine\n\n\nclass E(TorchTPEngine):\n    name = 'e'\n\n\n"
          "def make():\n    return E()\n")
"""A plugin built on a built-in engine (a class of the module that lacks TrainEngine's methods is refused before
any rank: qualify.engines.plugin_source)."""


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


def test_builtin_identity_covers_the_adapters_and_all_of_qualify():
    sources = engine_identity("torch-tp")["sources"]
    assert "qualify.engines:torch_tp.py" in sources and "qualify.engines:megatron_convert.py" in sources
    assert "qualify:candidate/worker.py" in sources and "qualify:ppo/objective.py" in sources
    assert "qualify:compare.py" in sources and "qualify:bounds/rule.py" in sources  # not a hand-kept list


def test_unknown_engine_has_no_identity():
    with pytest.raises(EngineError, match="unknown engine"):
        engine_identity("no-such-engine")


def test_stale_reason_names_what_changed(tmp_path, plugin):
    matrix = load_matrix(TINY)
    case = matrix.cases()[0]
    spec = make_spec(matrix.case_settings, case, model_dir=tmp_path, rollout_dir=tmp_path, targets_dir=tmp_path,
                     rollout_digest="r", targets_digest="t", case_dir=tmp_path / "case", vocab_size=512, device="cpu")
    key = resume_key(spec, {"digest": "sha256:a"})
    prepare_stage(tmp_path / "case")
    complete_stage(tmp_path / "case", {"key": key | {KEY: record(work_dir(tmp_path / "case"))}})
    assert stale_reason(tmp_path / "case", key) is None
    assert stale_reason(tmp_path / "case", key | {"acceptance": "sha256:b"}) == "acceptance changed since it was sealed"
    other = resume_key(spec.__class__(**{**{f: getattr(spec, f) for f in spec.__slots__}, "engine": "my_engine:make"}),
                       {"digest": "sha256:a"})
    assert stale_reason(tmp_path / "case", other) == "spec, engine code changed since it was sealed"
    complete_stage(tmp_path / "case", {})  # sealed by an older qualify: no key at all
    assert "spec" in stale_reason(tmp_path / "case", key)


def test_a_module_the_ranks_imported_that_changed_makes_the_case_stale(tmp_path, monkeypatch):
    """A bug put into a module a plugin imports (or into the installed peer library it wraps): the case's seal holds
    the digest of every file its ranks imported from outside qualify/ and the standard library, hashed again before
    reuse."""
    helper = tmp_path / "peer_loss.py"
    helper.write_text("def loss(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    importlib.import_module("peer_loss")
    try:
        assert str(helper.resolve()) in imported_files()
        assert not any(Path(p).is_relative_to(QUALIFY) for p in imported_files())  # in the key before launch
        assert str(Path(json.__file__).resolve()) not in imported_files()  # the standard library is not
        case = tmp_path / "case"
        prepare_stage(case)
        complete_stage(case, {"key": {"spec": "s", KEY: record(work_dir(case))}})
        assert stale_reason(case, {"spec": "s"}) is None
        helper.write_text("def loss(x):\n    return 2 * x\n")  # the peer library changed; nothing else did
        assert stale_reason(case, {"spec": "s"}) == "imported code changed since it was sealed"
        (work_dir(case) / "imported.json").unlink()  # nothing recorded: never reused
        assert stale_reason(case, {"spec": "s"}) == "imported code changed since it was sealed"
    finally:
        sys.modules.pop("peer_loss", None)



def reused_after(case: Path, change) -> str | None:
    """Seal a case with what this process imported, apply change, and say why the case would not be reused."""
    prepare_stage(case)
    complete_stage(case, {"key": {"spec": "s", KEY: record(work_dir(case))}})
    assert stale_reason(case, {"spec": "s"}) is None
    change()
    return stale_reason(case, {"spec": "s"})


@pytest.fixture
def imported_module(monkeypatch):
    """Import a module under a fresh name (whatever loader its location takes); it is forgotten afterwards."""
    names = []

    def load(name: str, where: Path):
        monkeypatch.syspath_prepend(str(where))
        import importlib

        importlib.invalidate_caches()
        names.append(name)
        return importlib.import_module(name)
    yield load
    for name in names:
        for loaded in [m for m in sys.modules if m.split(".")[0] == name.split(".")[0]]:
            sys.modules.pop(loaded)


def test_a_module_imported_from_a_zip_archive_that_changed_makes_the_case_stale(tmp_path, imported_module):
    """A zip archive on PYTHONPATH (zipimport): the member the rank imported is hashed, not only .py files on disk."""
    import zipfile

    archive = tmp_path / "peer.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("zipped_peer_loss.py", "def loss(x):\n    return x\n")
        z.writestr("other.txt", "unrelated")
    module = imported_module("zipped_peer_loss", archive)
    assert module.__file__ == str(archive / "zipped_peer_loss.py") and module.loss(3) == 3
    assert str(archive.resolve() / "zipped_peer_loss.py") in imported_files()

    def edit_member() -> None:
        with zipfile.ZipFile(archive, "w") as z:
            z.writestr("zipped_peer_loss.py", "def loss(x):\n    return 2 * x\n")
            z.writestr("other.txt", "unrelated")
    assert reused_after(tmp_path / "case", edit_member) == "imported code changed since it was sealed"


def test_a_sourceless_pyc_that_changed_makes_the_case_stale(tmp_path, imported_module):
    """A module shipped as a .pyc alone (SourcelessFileLoader): its bytecode is hashed."""
    import py_compile

    src, where = tmp_path / "src" / "compiled_peer.py", tmp_path / "lib"
    src.parent.mkdir()
    where.mkdir()
    src.write_text("def loss(x):\n    return x\n")
    py_compile.compile(str(src), cfile=str(where / "compiled_peer.pyc"), doraise=True)
    module = imported_module("compiled_peer", where)
    assert module.__file__.endswith("compiled_peer.pyc") and module.loss(3) == 3

    def recompile() -> None:
        src.write_text("def loss(x):\n    return 2 * x\n")
        py_compile.compile(str(src), cfile=str(where / "compiled_peer.pyc"), doraise=True)
    assert reused_after(tmp_path / "case", recompile) == "imported code changed since it was sealed"


def test_an_extension_module_that_changed_makes_the_case_stale(tmp_path, monkeypatch):
    """A compiled extension (.so) imported from outside the standard library: its file is hashed."""
    import importlib.util
    import sysconfig

    dynload = Path(sysconfig.get_config_var("DESTSHARED") or "/nonexistent")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    name = next((n for n in ("xxlimited", "xxlimited_35") if (dynload / (n + suffix)).is_file()
                 and n not in sys.modules), None)
    if name is None:
        pytest.skip("this Python has no xxlimited test extension to copy")
    copy = tmp_path / (name + suffix)
    copy.write_bytes((dynload / (name + suffix)).read_bytes())
    spec = importlib.util.spec_from_file_location(name, copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, name, module)
    assert str(copy.resolve()) in imported_files()

    def rebuild() -> None:  # a new file over the old one: the loaded library keeps its own (mapped) bytes
        new = tmp_path / "rebuilt.so"
        new.write_bytes(copy.read_bytes() + b"\0")
        new.replace(copy)
    assert reused_after(tmp_path / "case", rebuild) == "imported code changed since it was sealed"


def test_a_namespace_package_is_skipped_and_its_modules_are_hashed(tmp_path, imported_module):
    """A namespace package has no file of its own; the module imported from it is recorded."""
    (tmp_path / "nspeer").mkdir()
    (tmp_path / "nspeer" / "loss.py").write_text("def loss(x):\n    return x\n")
    imported_module("nspeer.loss", tmp_path)
    assert sys.modules["nspeer"].__file__ is None  # a namespace package
    files = imported_files()
    assert str((tmp_path / "nspeer" / "loss.py").resolve()) in files
    assert not any(Path(f).name == "nspeer" for f in files)
