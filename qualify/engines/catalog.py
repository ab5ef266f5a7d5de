"""The built-in engines qualify ships, as data: each name, where its adapter class is, what the class is built with and
what the engine can take. Adding a built-in engine is one entry of CATALOG.

This module imports nothing of qualify and no framework: the matrix's validation (qualify.matrix.engine_names) reads
it below the engines' floor, and the registry (qualify.engines.registry) builds each engine from it, importing the
adapter only then.
"""

from __future__ import annotations

from dataclasses import dataclass

_MEGATRON_UNPACKED = ("megatron-core's local layer spec (no Transformer Engine) attends with DotProductAttention, which "
                      "refuses packed sequences (its THD format, PackedSeqParams with cu_seqlens, needs "
                      "TEDotProductAttention)")


@dataclass(frozen=True, slots=True)
class BuiltinEngine:
    """One built-in engine: its name in matrices, its adapter class ('package.module:Class', imported when the engine
    is made) and the keyword arguments the class is called with, the family its variants share, the third-party
    modules a CPU launch's fork server imports before forking its ranks, why it cannot take packed batches (None: it
    can), and whether it shards the embedding by vocabulary under TP (the others keep it whole on every rank)."""

    name: str
    adapter: str
    kwargs: tuple[tuple[str, object], ...] = ()
    family: str = ""
    preload: tuple[str, ...] = ()
    unpacked: str | None = None
    vocab_sharded: bool = False


_DEEPSPEED = "qualify.engines.deepspeed_engine:DeepSpeedEngine"
_MEGATRON = "qualify.engines.megatron:MegatronEngine"
_FSDP2_PRELOAD = ("torch.distributed.fsdp", "torch.distributed.tensor.parallel")

CATALOG: tuple[BuiltinEngine, ...] = (
    BuiltinEngine(name="torch-tp", adapter="qualify.engines.torch_tp:TorchTPEngine"),
    BuiltinEngine(name="deepspeed", adapter=_DEEPSPEED, kwargs=(("zero_stage", 0),), family="deepspeed",
                  preload=("deepspeed",)),
    BuiltinEngine(name="megatron", adapter=_MEGATRON, kwargs=(("distributed_optimizer", False),), family="megatron",
                  unpacked=_MEGATRON_UNPACKED, vocab_sharded=True),
    BuiltinEngine(name="deepspeed-zero1", adapter=_DEEPSPEED, kwargs=(("zero_stage", 1),), family="deepspeed",
                  preload=("deepspeed",)),
    BuiltinEngine(name="deepspeed-zero2", adapter=_DEEPSPEED, kwargs=(("zero_stage", 2),), family="deepspeed",
                  preload=("deepspeed",)),
    BuiltinEngine(name="deepspeed-zero3", adapter=_DEEPSPEED, kwargs=(("zero_stage", 3),), family="deepspeed",
                  preload=("deepspeed",)),
    BuiltinEngine(name="megatron-distopt", adapter=_MEGATRON, kwargs=(("distributed_optimizer", True),),
                  family="megatron", unpacked=_MEGATRON_UNPACKED, vocab_sharded=True),
    BuiltinEngine(name="fsdp2", adapter="qualify.engines.fsdp2:FSDP2Engine", preload=_FSDP2_PRELOAD),
)
"""Every built-in engine, in the order qualify lists them. fsdp2 preloads torch's own FSDP2 and DTensor parallel
modules; megatron runs on GPUs only, where ranks start fresh, and preloads nothing."""

BY_NAME = {engine.name: engine for engine in CATALOG}

BUILTIN_ENGINES = tuple(engine.name for engine in CATALOG)
"""The engines qualify ships (qualify.engines.registry builds each by name); any other is a 'module:factory' plugin."""
DEEPSPEED_ENGINES = tuple(engine.name for engine in CATALOG if engine.family == "deepspeed")
"""DeepSpeed at ZeRO stage 0 (plain deepspeed) to 3, the stage each one's index: one adapter, the stage its setting."""
MEGATRON_ENGINES = tuple(engine.name for engine in CATALOG if engine.family == "megatron")
"""Megatron without and with its distributed optimizer: one adapter, the optimizer its setting."""
VOCAB_SHARDING_ENGINES = tuple(engine.name for engine in CATALOG if engine.vocab_sharded)
"""Engines that shard the embedding by vocabulary; the others keep it whole on every rank (torch-tp's plan,
DeepSpeed's AutoTP)."""
UNPACKED_ENGINES = {engine.name: engine.unpacked for engine in CATALOG if engine.unpacked is not None}
"""Built-in engines that cannot take packed batches, and why (a plugin says it can with a class attribute packed = True:
qualify.engines.base.TrainEngine)."""
