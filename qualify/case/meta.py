"""CaseMeta: a candidate case's meta.json, typed (written by qualify.candidate.worker's rank 0 when it seals the case).

Written: the gradients' and optimizer state's dtypes, each replicated parameter's largest difference across ranks,
the padded vocabulary rows (untouched or not, per rank), the padding found on each rank, parameters beyond the
checkpoint's, the number of steps, whether the engine brought its own objective, the cross-rank contract, the sampler
derivation's worst token per step, the layout probe; with an entropy bonus the entropy derivation, under routing
replay the routes replayed, with rollout layers the exact tier's layer counts; the case's spec, its time and where it
went, and the provenance (qualify.versions.provenance: versions, host, platform, slurm). The values are JSON's
(json_safe: a non-finite float is the string 'nan' or 'inf'); the spec stays the JSON document it was sealed as.

from_json reads what the worker writes, and remembers which keys were there (the optional ones are written only where
they apply), so that to_json gives back the same document, key for key and in the same order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError
from qualify.rolemeta import RoleMeta

NAME = "meta.json"
"""The file's name in the case's evidence directory."""


@dataclass(frozen=True)
class CaseMeta:
    """One case's meta.json (see the module's docstring); present: the keys the document holds."""

    grad_dtypes: dict[str, str] = field(default_factory=dict)
    state_dtypes: dict[str, str] = field(default_factory=dict)
    replica_max_abs: dict[str, Any] = field(default_factory=dict)
    padded_rows: dict[str, Any] = field(default_factory=dict)
    padding: list[Any] = field(default_factory=list)
    extra_params: list[str] = field(default_factory=list)
    num_steps: int = 0
    own_objective: bool = False
    contract: dict[str, Any] | None = None
    sampler_derivation: list[Any] | None = None
    layout: dict[str, Any] | None = None
    entropy_derivation: list[Any] | None = None
    routing_replay: list[Any] | None = None
    rollout_layers: dict[str, Any] | None = None
    case: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)
    versions: dict[str, Any] | None = None
    host: dict[str, Any] | None = None
    platform: dict[str, Any] | None = None
    slurm: dict[str, Any] | None = None
    present: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CaseMeta:
        """The meta of a meta.json document (keys it does not hold take their defaults and are not written back);
        a document that is not an object, or a key no CaseMeta field names, is an EvidenceError naming it."""
        known = KEYS
        if not isinstance(doc, dict):
            raise EvidenceError(f"a case's {NAME} holds {type(doc).__name__}, not an object")
        unknown = [k for k in doc if k not in known]
        if unknown:
            raise EvidenceError(f"a case's {NAME} holds keys a case's meta does not have: {', '.join(map(str, unknown))}")
        return cls(**{k: doc[k] for k in known if k in doc}, present=frozenset(doc))

    @classmethod
    def of(cls, meta: CaseMeta | RoleMeta | dict[str, Any]) -> CaseMeta:
        """meta as a CaseMeta: one already typed, a case directory's meta.json as its steps were read with it
        (qualify.compare.RunTensors.meta, a RoleMeta holding the document key for key), or the document itself."""
        if isinstance(meta, CaseMeta):
            return meta
        return cls.from_json(meta.to_json() if isinstance(meta, RoleMeta) else meta)

    @classmethod
    def written(cls, **values: Any) -> CaseMeta:
        """The meta the worker writes: every key given (None included) is written."""
        return cls(**values, present=frozenset(values))

    def to_json(self) -> dict[str, Any]:
        """The document: the keys present, in the order the worker writes them."""
        return {k: getattr(self, k) for k in KEYS if k in self.present}

    @property
    def spec(self) -> dict[str, Any]:
        """The case's sealed spec ({} where the meta records none)."""
        return self.case or {}


KEYS = tuple(f.name for f in dataclasses.fields(CaseMeta) if f.name != "present")
"""meta.json's keys, in the order the worker writes them."""


def read_case_meta(case_dir: Path) -> CaseMeta:
    """The meta.json of a case's evidence directory (a missing or malformed one: EvidenceError)."""
    from qualify.store import read_json

    return CaseMeta.from_json(read_json(Path(case_dir) / NAME))
