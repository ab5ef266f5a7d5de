"""The built-in engines are one catalog (qualify.engines.catalog.CATALOG): the matrix's engine-name policy and the
registry both read it, so one entry adds an engine. The catalog imports nothing of qualify and no framework; each
entry's adapter is a class its module's source binds; the registry builds, names and preloads exactly its entries."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from qualify.engines import catalog
from qualify.engines.catalog import (
    BUILTIN_ENGINES,
    CATALOG,
    DEEPSPEED_ENGINES,
    MEGATRON_ENGINES,
    UNPACKED_ENGINES,
    VOCAB_SHARDING_ENGINES,
)
from qualify.engines.registry import ENGINES, PRELOAD, factory_problem
from qualify.matrix import engine_name_problem


def test_the_catalog_imports_nothing_but_the_standard_library():
    tree = ast.parse(Path(catalog.__file__).read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "dataclasses"}, imported


def test_the_names_are_the_catalogs_in_its_order():
    assert BUILTIN_ENGINES == ("torch-tp", "deepspeed", "megatron", "deepspeed-zero1", "deepspeed-zero2",
                               "deepspeed-zero3", "megatron-distopt", "fsdp2")
    assert DEEPSPEED_ENGINES == ("deepspeed", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3")
    assert MEGATRON_ENGINES == ("megatron", "megatron-distopt")
    assert set(UNPACKED_ENGINES) == set(MEGATRON_ENGINES) == set(VOCAB_SHARDING_ENGINES)
    assert len(set(BUILTIN_ENGINES)) == len(CATALOG)


@pytest.mark.parametrize("engine", CATALOG, ids=lambda e: e.name)
def test_every_entry_is_a_class_its_module_binds_and_the_registry_builds_it(engine):
    assert importlib.util.find_spec(engine.adapter.partition(":")[0]) is not None
    assert factory_problem(engine.adapter) is None  # read from the module's source, nothing imported
    assert engine_name_problem(engine.name) is None and engine.name in ENGINES
    assert PRELOAD.get(engine.name, ()) == engine.preload


def test_the_stages_and_the_optimizer_are_the_entries_settings():
    assert [dict(e.kwargs) for e in CATALOG if e.name in DEEPSPEED_ENGINES] == [{"zero_stage": s} for s in range(4)]
    assert [dict(e.kwargs) for e in CATALOG if e.name in MEGATRON_ENGINES] == [
        {"distributed_optimizer": False}, {"distributed_optimizer": True}]
    assert PRELOAD == {**dict.fromkeys(DEEPSPEED_ENGINES, ("deepspeed",)),
                       "fsdp2": ("torch.distributed.fsdp", "torch.distributed.tensor.parallel")}


def test_the_registry_builds_the_entry_it_names():
    engine = ENGINES["torch-tp"]()
    assert type(engine).__name__ == "TorchTPEngine"


def test_a_name_outside_the_catalog_is_refused_naming_the_catalog():
    """Negative control: a name that no entry gives and that is no plugin is refused, listing the catalog's names."""
    problem = engine_name_problem("deepspeed-zero4")
    assert problem is not None and all(name in problem for name in BUILTIN_ENGINES)
    assert "deepspeed-zero4" not in ENGINES
