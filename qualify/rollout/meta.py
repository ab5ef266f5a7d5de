"""RolloutMeta: a sealed rollout's rollout.json, typed (written by qualify.rollout.capture for the reference's rollout
and by qualify.rounds.stage for each round's; read by the reference summary, the judge, the rounds and engines that
compute with vLLM's own kernels, such as qualify.examples.vllm_gpu_exact).

Written: vLLM's TP degree, the sampling settings with the dtype, the logprobs mode, each row's finish reason, the KV
block size, vLLM's model runner, the timings, the model and its digest, vLLM's environment, the platform and
provenance, the engine against itself (prefill_vs_decode); in batch-invariant mode the mode's settings, for a MoE
actor its routes (source, MoE layers), with layer outputs their record (names, rows); the tensors' digest. A round's
holds fewer (its version, TP, sampling, block size and runner). What the readers read is typed here, each field absent
from an older rollout reading as None; the whole document is kept as written, so that to_json gives it back key for
key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError

NAME = "rollout.json"
"""The file's name in a rollout directory."""


@dataclass(frozen=True)
class RolloutMeta:
    """One rollout directory's rollout.json (see the module's docstring)."""

    dtype: str | None = None
    """sampling.dtype: the precision vLLM sampled in ('bfloat16', 'float32', ...)."""
    block_size: int | None = None
    """The KV cache's block size (None for a rollout sealed before it was recorded)."""
    model_runner: str | None = None
    """vLLM's model runner, 'v1' or 'v2' (None for a rollout sealed before it was recorded)."""
    batch_invariant: bool = False
    """Sampled in vLLM's batch-invariant mode (its settings recorded, or VLLM_BATCH_INVARIANT=1 in vLLM's env)."""
    platform: dict[str, Any] | None = None
    """The platform vLLM ran on, as the capture recorded it."""
    prefill_vs_decode: dict[str, Any] | None = None
    """The rollout engine against itself (qualify.rollout.capture.prefill_vs_decode); None before the check."""
    routes_source: str | None = None
    """routes.source: how a MoE actor's routes were recorded (None: no routes)."""
    moe_layers: list[int] | None = None
    """routes.moe_layers: the MoE layer ids the routes cover (None: no routes)."""
    layer_names: list[str] | None = None
    """layer_outputs.names: the layers whose activations were recorded (None: none recorded)."""
    layer_rows: list[int] | None = None
    """layer_outputs.rows: the rows that hold activations (None: none recorded)."""
    document: dict[str, Any] = field(default_factory=dict)
    """The document as written (to_json gives it back)."""

    @classmethod
    def from_json(cls, doc: Any, where: str = NAME) -> RolloutMeta:
        """The typed document; one that is not an object, or whose read fields have the wrong type, is refused."""
        if not isinstance(doc, dict):
            raise EvidenceError(f"{where}: not a JSON object")
        sampling, env = _part(doc, "sampling", where), _part(doc, "env", where)
        routes, layers = _part(doc, "routes", where), _part(doc, "layer_outputs", where)
        read = {"dtype": _typed(sampling.get("dtype"), str, "sampling.dtype", where),
                "block_size": _typed(doc.get("block_size"), int, "block_size", where),
                "model_runner": _typed(doc.get("model_runner"), str, "model_runner", where),
                "platform": _typed(doc.get("platform"), dict, "platform", where),
                "prefill_vs_decode": _typed(doc.get("prefill_vs_decode"), dict, "prefill_vs_decode", where),
                "routes_source": _typed(routes.get("source"), str, "routes.source", where),
                "moe_layers": _typed(routes.get("moe_layers"), list, "routes.moe_layers", where),
                "layer_names": _typed(layers.get("names"), list, "layer_outputs.names", where),
                "layer_rows": _typed(layers.get("rows"), list, "layer_outputs.rows", where)}
        invariant = bool(doc.get("batch_invariant")) or env.get("VLLM_BATCH_INVARIANT") == "1"
        return cls(**read, batch_invariant=invariant, document=dict(doc))

    def to_json(self) -> dict[str, Any]:
        """The document as written."""
        return dict(self.document)


def _part(doc: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """doc[key], an object ({} where not written or null)."""
    part = doc.get(key)
    if part is None:
        return {}
    if not isinstance(part, dict):
        raise EvidenceError(f"{where}: {key} is not an object")
    return part


def _typed(value: Any, kind: type, name: str, where: str) -> Any:
    """value where it is None or of kind; another type is refused naming the key."""
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise EvidenceError(f"{where}: {name} {value!r} is not a {kind.__name__}")
    return value


def read_rollout_meta(rollout_dir: Path | str) -> RolloutMeta:
    """A rollout directory's rollout.json, typed (a missing or malformed one: EvidenceError)."""
    from qualify.store import read_json

    path = Path(rollout_dir) / NAME
    return RolloutMeta.from_json(read_json(path), str(path))
