"""`qualify rounds`: PPO rounds with the actor's new weights installed into one running vLLM engine.

Round 0 rolls out with v0 (the reference rollout when the run has one), the candidate engine
trains one actor step (fp32), and v1 = v0 + update is installed on every vLLM rank: each rank
acknowledges (rank, version, digest of each tensor it holds), the harness compares them with the
shards it derives itself from v1, resets the prefix cache, and only then acks the version. Round r
rolls out with v(r); its logprobs must agree with an HF forward of v(r) within the logprob bound
(qualify.rounds.base), its first request after the install must find nothing cached, and a
same-version replay must find the cache warm. The probes (qualify.rounds.probes) follow on the
same engine process. Reference, reward and critic models and the round-0 targets must be
bitwise unchanged at the end. Evidence: RUN_DIR/rounds/vllm-tp<N>/ (sealed), with its verdict.json.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from qualify.case.meta import read_case_meta
from qualify.engines.registry import require_engine
from qualify.errors import EvidenceError, QualifyError
from qualify.hashing import file_digest
from qualify.layout import RunLayout, rounds_case
from qualify.matrix import Matrix, Rounds
from qualify.models.checkpoint import checkpoint_tensors
from qualify.reference.stage import prepare_models
from qualify.rollout.capture import ROLLOUT_FILE, load_rollout, rollout_tensors
from qualify.rounds import checks
from qualify.rounds.base import Base, resolve_base
from qualify.rounds.client import EngineCrash, Refused
from qualify.rounds.digests import digests_of, version_digest
from qualify.rounds.probes import failure_probes, stale_probes
from qualify.rounds.session import InstallRejected, Session
from qualify.rounds.train import TrainFailed, train_step
from qualify.rounds.weights import Version, load_version, write_version
from qualify.stagelog import StageLog
from qualify.stages import complete_stage, prepare_stage, stage_is_complete, write_tensor_stage
from qualify.store import read_json, write_json
from qualify.verdict import ROUNDS_SCHEMA, Verdict, fact, make_verdict
from qualify.versions import provenance

FROZEN_ROLES = ("reference", "reward", "critic")


RoundsOptions = Rounds
"""How a rounds run is made: the matrix's rounds section (qualify.matrix.Rounds), with overrides."""


def rounds_options(matrix: Matrix, *, engine: str | None = None, rounds: int | None = None,
                   vllm_tp: int | None = None, train_tp: int | None = None,
                   probes: tuple[str, ...] | None = None, train_precision: str | None = None) -> RoundsOptions:
    """The matrix's rounds settings, each overridden where given (the command line, or a Slurm topology)."""
    given = {"engine": engine, "rounds": rounds, "vllm_tp": vllm_tp, "train_tp": train_tp, "probes": probes,
             "train_precision": train_precision}
    try:
        options = dataclasses.replace(matrix.rounds, **{k: v for k, v in given.items() if v is not None})
        # the whole matrix with them: a TP degree must divide the model's heads and MLP, as the matrix's own must
        changed = dataclasses.replace(matrix, rounds=options)
    except ValueError as exc:  # the section's own validation, for a value the command line gave
        raise QualifyError(f"rounds: {exc}") from exc
    if changed.models.checkpoints is not None:
        changed.check_checkpoint_family()
    return options


def frozen_digests(base: Base, targets_file: Path | None, captured: Path | None = None) -> dict[str, str]:
    """Digest of every model that must stay frozen, and of the round-0 targets and rollout."""
    out = {role: version_digest(digests_of(checkpoint_tensors(base.models[role]))) for role in FROZEN_ROLES}
    if targets_file is not None:
        out["round-0 targets"] = file_digest(targets_file)
    rollout = base.rollout_dir or captured
    if rollout is not None and (rollout / ROLLOUT_FILE).is_file():
        out["round-0 rollout"] = file_digest(rollout / ROLLOUT_FILE)
    return out


def write_rollout(out: Path, results: list[dict[str, Any]], info: dict[str, Any],
                  routes_layers: list[int] | None = None) -> str:
    """Seal a round's rollout in the reference's rollout format (a MoE actor's with its routes, routes_layers its
    MoE layer ids); return its digest."""
    from qualify.rollout.routes import SOURCE

    routes = {} if routes_layers is None else {"routes": {"source": SOURCE, "moe_layers": routes_layers}}
    return write_tensor_stage(out, ROLLOUT_FILE, rollout_tensors(results), "rollout.json", info | routes | {
        "logprobs_mode": "processed_logprobs", "finish_reasons": [r["finish_reason"] for r in results]})


def write_targets(s: Session, out: Path, rollout_dir: Path, digest: str) -> str:
    """Targets of a round's own rollout, from the frozen models (fp32); return their digest."""
    from qualify.reference.targets import TARGETS_FILE, compute_targets, targets_meta

    settings = s.settings
    targets = compute_targets(settings.objective, settings.reference, settings.rollout, s.base.models,
                              load_rollout(rollout_dir, digest), s.vocab)
    return write_tensor_stage(out, TARGETS_FILE, targets, "targets.json",
                              targets_meta(settings.objective, settings.rollout, digest), {"rollout_digest": digest})


def cache_rows(s: Session, rnd: int, version: Version, first: dict[str, Any], what: str) -> dict[str, Any]:
    """After a first request: replay the cache prompts; check cold, warm, identical and agreeing."""
    n = len(s.cache_prompts)
    first_cache = first["results"][-n:]
    replay = s.generate(s.cache_prompts, s.cache_seeds)
    block = s.settings.rollout.block_size
    s.add(checks.cold_row("first request after install: nothing cached" if rnd else "fresh engine: nothing cached",
                          rnd, [r["num_cached_tokens"] for r in first["results"]], what))
    s.add(checks.warm_row("same-version replay reuses the cache", rnd,
                          [r["num_cached_tokens"] for r in replay["results"]], block,
                          f"cache prompts of {len(s.cache_prompts[0])} tokens replayed at v{version.number}"))
    s.add(checks.same_tokens_row("replay samples the same tokens", rnd, first_cache, replay["results"]))
    stats = s.agreement(version, replay["results"])
    s.add(checks.agreement_row("replay logprobs agree with HF", rnd, stats, s.base.bound, version.number))
    return {"first_cached_tokens": [r["num_cached_tokens"] for r in first["results"]],
            "replay_cached_tokens": [r["num_cached_tokens"] for r in replay["results"]],
            "served_version": [first["version"], replay["version"]], "replay_agreement": stats}


def round_zero(s: Session, v0: Version, rdir: Path) -> tuple[Path, str]:
    """Round 0: the cache behaves, the engine serves v0 as HF computes it; returns the rollout to train on."""
    first = s.generate(s.cache_prompts, s.cache_seeds)
    if s.base.rollout_dir is None:  # no reference: round 0 captures its rollout with this engine
        captured = s.generate(s.prompts, s.seeds, rollout=True)
        s.base.control = s.agreement(v0, captured["results"])["max_abs"]
        digest = write_rollout(rdir / "rollout", captured["results"], s.rollout_meta(0),
                               captured.get("routes_layers"))
        rollout_dir = rdir / "rollout"
        s.made["round-0 rollout"] = digest
    else:
        rollout_dir, digest = s.base.rollout_dir, s.base.rollout_digest
    stats = s.agreement(v0, first["results"], rdir / "agreement.safetensors")
    s.add(checks.agreement_row("logprobs agree with HF", 0, stats, s.base.bound, 0))
    evidence = {"version": 0, "rollout_digest": digest, "agreement": stats,
                **cache_rows(s, 0, v0, first, "cache prompts on a fresh engine")}
    write_json(rdir / "round.json", evidence)
    return rollout_dir, digest


def later_round(s: Session, version: Version, prev: Version, rdir: Path) -> tuple[Path, str]:
    """Round r >= 1: the first request after the install rolls out with v(r), cold; then the replay."""
    first = s.generate(s.prompts + s.cache_prompts, s.seeds + s.cache_seeds, rollout=True)
    rnd = version.number
    s.add(checks.equal_row("engine serves the installed version", rnd, first["version"], rnd))
    stats = s.agreement(version, first["results"], rdir / "agreement.safetensors")
    s.add(checks.agreement_row("rollout logprobs agree with HF", rnd, stats, s.base.bound, rnd))
    stale = s.agreement(prev, first["results"])
    s.add(checks.sensitivity_row(rnd, stale, s.base.bound, rnd, prev.number))
    digest = write_rollout(rdir / "rollout", first["results"][:len(s.prompts)], s.rollout_meta(rnd),
                           first.get("routes_layers"))
    evidence = {"version": rnd, "rollout_digest": digest, "agreement": stats, "agreement_vs_previous": stale,
                **cache_rows(s, rnd, version, first, f"rollout and cache prompts, first request at v{rnd}")}
    write_json(rdir / "round.json", evidence)
    return rdir / "rollout", digest


def train_and_install(s: Session, opts: RoundsOptions, version: Version, rollout: tuple[Path, str],
                      targets: tuple[Path, str], rdir: Path) -> Version:
    """Train one step on the round's rollout, make v(r+1), install it on every rank."""
    with s.log.step(f"round {version.number}: train one actor step ({opts.engine}, {opts.train_precision}, "
                    f"TP{opts.train_tp})"):
        step = train_step(s.settings, engine=opts.engine, tp=opts.train_tp, model_dir=version.path,
                          rollout_dir=rollout[0], rollout_digest=rollout[1], targets_dir=targets[0],
                          targets_digest=targets[1], out=rdir / "train", vocab_size=s.vocab,
                          precision=opts.train_precision)
    s.add(checks.rollout_exact_row(version.number, checks.rollout_exact(rdir / "train", targets[0])))
    replayed = checks.routes_replayed(read_case_meta(rdir / "train"))
    if replayed is not None:  # the round's own routes, not an earlier round's (captured before the weight sync)
        s.add(checks.equal_row(checks.ROUTES_REPLAYED, version.number, replayed[0], 0, replayed[1]))
    new = write_version(version, step["updates"], s.out / "versions" / f"v{version.number + 1}",
                        {"trained_by": step["case"], "loss": step["loss"], "grad_norm": step["grad_norm"]})
    with s.log.step(f"install v{new.number} on {s.tp} vLLM rank(s)"):
        record = s.install(new)
    s.add(checks.equal_row("every rank acknowledges the installed version", new.number,
                           sorted([a["rank"], a["version"]] for a in record["acks"]),
                           [[r, new.number] for r in range(s.tp)], f"version digest {new.digest}"))
    write_json(rdir / "install.json", {k: v for k, v in record.items() if k != "rank_tensors"} |
               {"rank_tensors": record["rank_tensors"], "expected": s.expected(new)})
    return new


def run_all_rounds(s: Session, opts: RoundsOptions, v0: Version) -> list[Version]:
    versions = [v0]
    with s.log.step(f"start vLLM TP{s.tp} at v0 and verify every rank"):
        write_json(s.out / "start.json", s.start(v0))
    for rnd in range(opts.rounds):
        rdir, version = s.out / f"round-{rnd}", versions[-1]
        with s.log.step(f"round {rnd}: roll out with v{rnd}, cache and logprob checks"):
            if rnd == 0:
                rollout = round_zero(s, v0, rdir)
            else:
                rollout = later_round(s, version, versions[-2], rdir)
        if rnd == 0 and "stale" in opts.probes:
            with s.log.step("probes: stale versions"):
                stale_probes(s, v0)
        if rnd < opts.rounds - 1:
            if rnd == 0 and s.base.targets_dir is not None:
                targets = (s.base.targets_dir, s.base.targets_digest)
            else:
                targets = (rdir / "targets", write_targets(s, rdir / "targets", *rollout))
                if rnd == 0:
                    s.made["round-0 targets"] = targets[1]
            versions.append(train_and_install(s, opts, version, rollout, targets, rdir))
    return versions


def run_rounds(matrix: Matrix, run_dir: Path, options: RoundsOptions | None = None) -> Verdict:
    """The whole rounds stage; returns the verdict (an existing complete one is returned as it is)."""
    opts = options or rounds_options(matrix)
    require_engine(opts.engine)
    layout, log = RunLayout(Path(run_dir)), StageLog("rounds")
    tp = opts.vllm_tp or matrix.rollout.vllm_tp[0]
    out = layout.rounds_dir(tp)
    if stage_is_complete(out):
        return reuse(out, tp, log, opts.rounds)
    base = resolve_base(layout, matrix.rollout.vllm_tp[0],
                        prepare_models(matrix.models, layout, matrix.resolve), matrix.freeze)
    prepare_stage(out)
    started = time.monotonic()
    s = Session(matrix.case_settings, matrix.capture, base, out, tp, log)
    v0 = load_version(0, base.models["actor"])
    frozen_before = frozen_digests(base, base.targets_dir / "targets.safetensors" if base.targets_dir else None)
    failure, versions = None, [v0]
    try:
        versions = run_all_rounds(s, opts, v0)
        failure_probes(s, versions, opts.probes)
    except (Refused, EngineCrash, InstallRejected, TrainFailed) as exc:
        failure = f"{type(exc).__name__}: {exc}"
        s.add(fact("rounds completed", None, failure, "no refusal, crash or rejection", False))
    finally:
        leftover = s.close()
    s.add(checks.equal_row("no /dev/shm segment left behind", None, leftover, []))
    targets0 = base.targets_dir / "targets.safetensors" if base.targets_dir else out / "round-0/targets/targets.safetensors"
    frozen_after = frozen_digests(base, targets0 if targets0.is_file() else None, out / "round-0" / "rollout")
    for name, digest in (frozen_before | s.made).items():
        s.add(checks.equal_row(f"{name} unchanged", None, frozen_after.get(name), digest))
    return finish(s, opts, matrix.name, versions, frozen_after, failure, time.monotonic() - started)


def reuse(out: Path, tp: int, log: StageLog, asked: int) -> Verdict:
    """A complete rounds run, reused only when every row is what its sealed evidence gives and it ran at least the
    rounds asked for now."""
    from qualify.rounds.rederive import rederive_problems

    doc = read_json(out / "verdict.json")
    bound = doc.get("bound", {}).get("logprob_max_abs") if isinstance(doc, dict) and isinstance(doc.get("bound"),
                                                                                                dict) else None
    problems = rederive_problems(out, doc, bound, asked) if isinstance(doc, dict) else ["not a rounds verdict"]
    if problems:
        raise EvidenceError(f"the sealed rounds verdict in {out} is {problems[0]}: move it away to run the rounds "
                            "again")
    log.skip(f"rounds at vLLM TP{tp}")
    return Verdict.from_json(doc)


def finish(s: Session, opts: RoundsOptions, matrix_name: str, versions: list[Version], frozen: dict[str, str],
           failure: str | None, seconds: float) -> Verdict:
    verdict = make_verdict(ROUNDS_SCHEMA, matrix_name, s.rows, [rounds_case(s.tp)], failure=failure, details={
        "engine": opts.engine, "rounds": opts.rounds, "vllm_tp": s.tp, "train_tp": opts.train_tp,
        "train_precision": opts.train_precision,
        "bound": {"logprob_max_abs": s.base.bound if s.base.control is not None else None, "k": s.base.k,
                  "floor": s.base.floor, "control": s.base.control, "source": s.base.source, **s.base.extra},
        "actor_versions": [{"version": v.number, "digest": v.digest, "path": str(v.path)} for v in versions],
        "frozen": frozen, "probes": s.probes, "seconds": round(seconds, 1), **provenance()})
    write_json(s.out / "verdict.json", verdict.to_json())
    complete_stage(s.out, {"passed": verdict.passed})
    return verdict
