"""`qualify diagnose`: where a candidate case first leaves its bounds, layer by layer, at step 1.

The acceptance (verified against the reference evidence) must hold layer bounds (qualify.bounds.layers, read through
qualify.bounds.files).
The case's engine is launched again from the case's own spec to expose its per-layer activations on the
first step's rows (qualify.diagnose.worker; sealed under RUN/diagnose/<case>/ and reused while the case's
evidence is unchanged); its step-1 gradients come from the case's sealed evidence. Each family the
candidate stage judges the case by (<precision>-repeat, and fp32-vs-bf16 for bf16) compares the candidate
with that family's reference run; the diagnosis names the first layer and tensor out of bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qualify.acceptance import Acceptance
from qualify.bounds.files import layer_bounds_named, read_layer_bounds
from qualify.bounds.layers import LAYERS_FILE, group_members, layer_metrics
from qualify.diagnose.localize import LayerRow, by_layer, first_departure, judge_layers
from qualify.errors import EvidenceError, QualifyError
from qualify.layout import RunLayout, launch_log, spec_file
from qualify.runname import RunName
from qualify.stagelog import StageLog
from qualify.stages import fingerprint, require_complete, stage_info, stage_is_complete
from qualify.store import json_safe, read_json, read_tensors, write_json

DIAGNOSIS_SCHEMA = "qualify.diagnosis/1"


def case_spec(layout: RunLayout, case: str) -> Any:
    """The sealed case's spec (written by the candidate stage beside its evidence)."""
    from qualify.case.spec import read_spec

    if not safe_name(case):
        raise QualifyError(f"--case {case!r} is not a case name (no path separators, not '.' or '..')")
    case_dir = layout.case(case)
    if not case_dir.is_dir():
        known = sorted(p.name for p in layout.candidates.iterdir() if layout.is_case_dir(p)) \
            if layout.candidates.is_dir() else []
        listed = ", ".join(known) or "none: run 'qualify candidate' first"
        raise QualifyError(f"no case {case!r} in {layout.candidates} (cases: {listed})")
    require_complete(case_dir, f"case {case} (run 'qualify candidate' for it first)")
    spec = spec_file(case_dir)
    if not spec.is_file():
        raise EvidenceError(f"case {case} has no spec at {spec} (run 'qualify candidate' for it again)")
    return moved_to(read_spec(spec), layout)


def safe_name(case: str) -> bool:
    """A case name names a directory under candidates/ and nothing else: no separator, not '.', '..' or hidden."""
    return bool(case) and not any(c in case for c in "/\\\0") and not case.startswith(".")


def moved_to(spec: Any, layout: RunLayout) -> Any:
    """The spec with its paths inside the run directory it was written in (models, rollout, targets, the case) moved
    into this one: a run directory copied or moved elsewhere is diagnosed where it is now (checkpoints outside the run
    stay where they are)."""
    from dataclasses import replace

    old_root = Path(spec.case_dir).parents[1]
    moved = {}
    for name in ("model_dir", "rollout_dir", "targets_dir", "case_dir"):
        path = Path(getattr(spec, name))
        if path.is_relative_to(old_root):
            moved[name] = str(layout.root / path.relative_to(old_root))
    return replace(spec, **moved)


def launch_worker(spec_path: Path, out: Path, key: str, ranks: int, device: str, log_path: Path,
                  engine: str = "") -> int:
    """qualify.diagnose.worker's ranks (the case's tp x dp), started the way the candidate stage starts a case's
    (qualify.case.launch)."""
    from qualify.case.launch import launch_env, start_module
    from qualify.engines.registry import preload_modules

    log_path.parent.mkdir(parents=True, exist_ok=True)
    return start_module("qualify.diagnose.worker", [str(spec_path), str(out), key], ranks, device,
                        launch_env(device, ranks), log_path, preload_modules(engine))


def candidate_layers(layout: RunLayout, case: str, spec: Any, log: StageLog) -> tuple[dict[str, Any], bool]:
    """(activations, whether the engine has the layer_outputs hook), launching the engine unless a sealed
    capture made from the same case evidence exists."""
    from qualify.case.launch import log_tail

    out = layout.diagnose / case
    key = fingerprint(stage_info(layout.case(case)))
    with log.step(f"layer outputs of {case} ({spec.engine}, TP{spec.tp} x DP{spec.dp}, {spec.precision})") as step:
        if stage_is_complete(out) and stage_info(out).get("key") == key:
            step.skip()
        else:
            log_path = launch_log(out)
            here = spec_file(out)  # the case's spec with its paths where the run directory is now (moved_to)
            here.parent.mkdir(parents=True, exist_ok=True)
            write_json(here, spec.to_json())
            code = launch_worker(here, out, key, spec.world_size, spec.device, log_path, spec.engine)
            if code != 0 or not stage_is_complete(out):
                raise EvidenceError(f"the engine of case {case} did not produce its layer outputs: "
                                    + log_tail(log_path, code))
    return read_tensors(out / LAYERS_FILE), bool(stage_info(out).get("hook"))


def grads_detail(group_key: str, cand: dict, ref: dict, acc: Acceptance, role: str, family: str) -> dict[str, Any]:
    """The parameter of a gradient group farthest out of its per-tensor bound (the acceptance's step0/grads/ bounds)."""
    from qualify.compare import RunTensors, pair_metrics, step_dir

    names = group_members(list(ref)).get(group_key.removeprefix("grads/"), [])
    measured = pair_metrics(RunTensors({}, {n: cand[n] for n in names if n in cand}, {}, {}),
                            RunTensors({}, {n: ref[n] for n in names}, {}, {}))
    bounds = acc.bounds(role, family)
    worst = None
    for key, ms in measured.items():
        for metric, value in ms.items():
            entry = bounds.get(f"{step_dir(0)}/{key}", {}).get(metric)
            if entry is not None:
                row = LayerRow(key, metric, value, float(entry["bound"]), value <= float(entry["bound"]))
                worst = row if worst is None or row.ratio > worst.ratio else worst
    return {} if worst is None else {"tensor": worst.key, "metric": worst.metric, "value": worst.value,
                                     "bound": worst.bound, "ratio": worst.ratio}


def families_of(precision: str) -> list[str]:
    """The families the candidate stage judges a case of this precision by (qualify.judge.case.judge_case)."""
    return [f"{precision}-repeat"] + (["fp32-vs-bf16"] if precision == "bf16" else [])


def diagnose_family(layout: RunLayout, acc: Acceptance, spec: Any, family: str, bounds_doc: dict[str, Any],
                    acts: dict[str, Any], hook: bool, cand_grads: dict[str, Any]) -> dict[str, Any]:
    """Rows, first departure and per-layer worst ratios of the case against one family."""
    from qualify.bounds.layers import run_layers

    fam = bounds_doc["families"][family]
    ref_acts, ref_grads = run_layers(layout.scores(*RunName.parse(fam["reference_run"]), spec.role))
    measured = layer_metrics(acts if hook else None, ref_acts, cand_grads, ref_grads)
    problems = {f"act/{n}": f"shape {tuple(acts[n].shape)} != {tuple(ref_acts[n].shape)}"
                for n in set(acts) & set(ref_acts) if acts[n].shape != ref_acts[n].shape}
    rows = judge_layers(measured, fam["bounds"], problems, forward=hook)
    first = first_departure(rows)
    departure = None
    if first is not None:
        departure = first.to_json()
        if first.phase == "backward":
            departure["detail"] = grads_detail(first.key, cand_grads, ref_grads, acc, spec.role, family)
    # the row nearest its bound: where to look when every layer is within bound but the case failed elsewhere
    closest = max(rows, key=lambda r: r.ratio, default=None)
    return {"reference_run": fam["reference_run"], "passed": first is None, "first_departure": departure,
            "closest": closest.to_json() if closest else None, "layers": by_layer(rows),
            "rows": [r.to_json() for r in rows]}


def diagnose(run_dir: Path, case: str, *, log: StageLog | None = None) -> dict[str, Any]:
    """Diagnose one sealed candidate case of run_dir; writes and returns the diagnosis (RUN/diagnose/<case>.json)."""
    from qualify.compare import step_dir

    layout = RunLayout(Path(run_dir))
    log = log or StageLog("diagnose")
    with log.step("verify the acceptance against the reference evidence"):
        acc = Acceptance.load(layout.acceptance, layout.reference)
    layer_bounds_named(acc.path, acc.document)
    spec = case_spec(layout, case)
    judged_by = (stage_info(layout.case(case)).get("key") or {}).get("acceptance")
    if judged_by != acc.digest:
        raise EvidenceError(f"case {case} was run against acceptance {judged_by}, not {acc.digest}: run 'qualify "
                            "candidate' for it again")
    bounds_doc = read_layer_bounds(acc.path, acc.document, spec.role)
    acts, hook = candidate_layers(layout, case, spec, log)
    cand_grads = read_tensors(layout.case(case) / step_dir(0) / "grads.safetensors")
    with log.step(f"compare {case} with the reference layer by layer"):
        families = {f: diagnose_family(layout, acc, spec, f, bounds_doc, acts, hook, cand_grads)
                    for f in families_of(spec.precision)}
    first = next(({"family": f, **d["first_departure"]} for f, d in families.items() if d["first_departure"]), None)
    doc = {"schema": DIAGNOSIS_SCHEMA, "case": case, "engine": spec.engine, "role": spec.role,
           "precision": spec.precision, "tp": spec.tp, "dp": spec.dp, "step": 0, "acceptance_digest": acc.digest,
           "layer_outputs_hook": hook, "passed": first is None, "first_departure": first, "families": families}
    doc = json_safe(doc)
    write_json(layout.diagnose / f"{case}.json", doc)
    return doc


def load_diagnoses(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Every diagnosis written in a run directory, by case (for the report)."""
    d = RunLayout(Path(run_dir)).diagnose
    if not d.is_dir():
        return {}
    out = {}
    for path in sorted(d.glob("*.json")):
        doc = read_json(path)
        if isinstance(doc, dict) and doc.get("schema") == DIAGNOSIS_SCHEMA:
            out[doc["case"]] = doc
    return out
