"""The reference's sealed evidence, read and written: targets, scored roles, the scoring fingerprint.

Shared by the reference stage (qualify.reference.stage), the replays on other clip decisions
(qualify.reference.forced) and what reads a step's inputs back (qualify.reference.inputs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qualify.bounds.layers import LAYERS_FILE
from qualify.compare import step_dir, write_step
from qualify.layout import RunLayout
from qualify.matrix import Matrix, ppo_as_before
from qualify.reference.targets import TARGETS_FILE
from qualify.schema import to_dict
from qualify.stages import complete_stage, fingerprint, open_sealed, prepare_stage
from qualify.store import read_tensors, write_json, write_tensors


def model_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def scoring_settings(matrix: Matrix, rollout_digest: str) -> str:
    """Fingerprint of what targets and scores depend on: the rollout and the numerics sections of the matrix."""
    m = to_dict(matrix)
    # what is kept (of the controls, of the layer activations) changes no number: the fingerprint is the same
    m["reference"] = {k: v for k, v in m["reference"].items() if k not in ("evidence", "layer_activations")}
    m["ppo"] = ppo_as_before(m["ppo"])  # the peer settings enter the fingerprint only where they are set
    grpo = ("algorithm", "grpo") if matrix.algorithm == "grpo" else ()  # a PPO matrix's fingerprint is unchanged
    # the packed control's budget (a candidates field): only where it is set, so other fingerprints are unchanged
    packing = {} if matrix.candidates.pack_tokens is None else {"pack_tokens": matrix.candidates.pack_tokens}
    return fingerprint({"rollout": rollout_digest, **packing,
                        **{k: m[k] for k in ("models", "ppo", "optimizer", "reference", *grpo)}})


def load_targets(layout: RunLayout, expected_digest: str | None = None) -> dict[str, Any]:
    """Read the sealed targets, checking their digest."""
    open_sealed(layout.targets, "targets", expected_digest, main=TARGETS_FILE)
    return read_tensors(layout.targets / TARGETS_FILE)


def write_role(out: Path, result: dict[str, Any], info: dict[str, Any], record: dict[str, Any] | None = None,
               lean: bool = False) -> None:
    """Seal one role's K steps: step<k>/{outputs,grads,updates,moments}.safetensors, and meta.json (and, for a run
    that is also a control measured while it ran, its record: qualify.bounds.records). lean (an r0 under
    reference.evidence lean, whose record holds its base_record): outputs and gradients only. The gradients are coded
    (bf16 values in bf16), not the moments: a reference run's files are each read on their own (a replay on another
    platform is its own gradients, moments and updates; qualify.tensor_codec's moments would read its gradients)."""
    from qualify.bounds.records import write_record
    from qualify.compare import GROUPS, LEAN_GROUPS

    if lean and (record is None or "base" not in record):
        raise ValueError("a run kept lean needs its record's base_record (what freeze needs of its updates)")
    prepare_stage(out)
    for k, step in enumerate(result["steps"]):
        write_step(out / step_dir(k), step, LEAN_GROUPS if lean else GROUPS)
    if "layers" in result:  # step 1's per-layer activations, for qualify diagnose (qualify.bounds.layers)
        write_tensors(out / LAYERS_FILE, result["layers"])
    if record is not None:
        write_record(out, record)
    kept = {"evidence": "lean"} if lean else {}
    write_json(out / "meta.json", result["meta"] | info | kept)
    complete_stage(out, info | kept)
