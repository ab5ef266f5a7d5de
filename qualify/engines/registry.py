"""Engine registry: a plain dict from name to factory, plus 'module:factory' plugins."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from qualify.engines.base import TrainEngine
from qualify.errors import EngineError

Factory = Callable[[], TrainEngine]


def _torch_tp() -> TrainEngine:
    from qualify.engines.torch_tp import TorchTPEngine

    return TorchTPEngine()


def _deepspeed() -> TrainEngine:
    from qualify.engines.deepspeed_engine import DeepSpeedEngine

    return DeepSpeedEngine()


def _megatron() -> TrainEngine:
    from qualify.engines.megatron import MegatronEngine

    return MegatronEngine()


ENGINES: dict[str, Factory] = {"torch-tp": _torch_tp, "deepspeed": _deepspeed, "megatron": _megatron}


def get_engine(name: str) -> TrainEngine:
    """Build the engine called name: a registered name or 'package.module:factory'."""
    if name in ENGINES:
        return ENGINES[name]()
    if ":" not in name:
        raise EngineError(f"unknown engine '{name}' (known: {', '.join(sorted(ENGINES))}; or 'module:factory')")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineError(f"cannot import engine plugin module '{module_name}': {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EngineError(f"engine plugin '{name}': {module_name} has no callable '{attr}'")
    return factory()
