"""Render the stage chain of a matrix on a cluster profile into sbatch scripts, byte for byte reproducibly.

The chain: reference -> freeze -> one candidate job array per resource shape (one task per
case) -> verdict, each waiting on the previous with afterok; on a GPU cluster also one
`qualify rounds` job per topology after freeze. A candidate job asks for the GPUs its case
uses (tp x dp): no vLLM runs in it. The topologies (vLLM and trainer on their own GPUs, or
colocated) belong to the rounds job, the one that runs both. Every job requeues and every
stage resumes, so a preempted job completes its work on the next start.
Templates fill `{{ slot }}` markers; there is no timestamp, host or absolute path in the output.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from qualify.errors import SlurmError
from qualify.matrix import Candidates, Case, Matrix, load_matrix
from qualify.slurm.profile import Profile, load_profile
from qualify.store import atomic_write_bytes

_SLOT = re.compile(r"\{\{ ([a-z0-9_]+) \}\}")
DEFAULT_TEMPLATES = Path(__file__).resolve().parents[2] / "sbatch" / "templates"
SCRIPT_SUFFIX = ".sbatch"


@dataclass(frozen=True, slots=True)
class Share:
    """What one job asks of a node."""

    gpus: int
    cpus: int
    mem_mb: int | None


@dataclass(frozen=True, slots=True)
class Job:
    """One sbatch script of the chain."""

    key: str
    """Unique within the chain: reference, freeze, candidate-<N>gpu or candidate-<N>cpu, verdict, rounds-<topology>."""
    stage: str
    """reference, freeze, candidate, verdict or rounds."""
    file: str
    """Script file name in the output directory."""
    after: tuple[str, ...]
    """Keys of the jobs this one waits for (afterok)."""
    cases: tuple[str, ...]
    """Case name per array index (empty: not an array)."""
    log: str
    """Log path as Slurm's --output pattern."""
    need: Share
    """What it asks of a node (each array task asks this)."""
    text: str
    """The script."""


@dataclass(frozen=True, slots=True)
class Chain:
    """Every job of one rendering, in submission order."""

    matrix: Matrix
    profile: Profile
    run: str
    out: Path
    jobs: tuple[Job, ...]

    def job(self, key: str) -> Job:
        return next(j for j in self.jobs if j.key == key)


def share(profile: Profile, *, gpus: int, procs: int, what: str) -> Share:
    """A node's share for a job using gpus GPUs (GPU cluster) or procs processes (CPU cluster)."""
    if profile.gpus_per_node == 0:
        units, per_node, gpus, cpus = procs, profile.cpus_per_node, 0, procs
    else:
        units, per_node = max(gpus, 1), profile.gpus_per_node
        cpus = max(1, profile.cpus_per_node * units // per_node)
    if units > per_node:
        unit = "GPUs" if profile.gpus_per_node else "CPUs"
        raise SlurmError(f"{what} needs {units} {unit}; a node of {profile.source} has {per_node}")
    mem = None if profile.mem_mb is None else profile.mem_mb * units // per_node
    return Share(gpus=gpus, cpus=cpus, mem_mb=mem)


def case_gpus(case: Case) -> int:
    """GPUs (or processes) of one candidate case: tp x dp; the rollout's vLLM does not run in a candidate job."""
    return case.tp * getattr(case, "dp", 1)  # a matrix without data parallelism: dp = 1


def rounds_gpus(vllm_tp: tuple[int, ...], candidate_tp: tuple[int, ...], topology: str) -> tuple[int, int, int]:
    """(vLLM TP, trainer TP, GPUs) of the rounds job: dedicated puts vLLM and the trainer on their own GPUs,
    shared colocates them. The largest degrees of the matrix: installing into every rank of the widest vLLM."""
    vllm, train = max(vllm_tp), max(candidate_tp)
    return vllm, train, vllm + train if topology == "dedicated" else max(vllm, train)


def check_memory(matrix: Matrix, profile: Profile, cases: list[Case]) -> None:
    """Refuse, with what each needs, a stage or case whose estimated memory (qualify.memory) does not fit one of the
    profile's GPUs or the host memory its job gets. Nothing is checked without gpu_mem in the profile, or when the
    checkpoints' config.json is not where the matrix says (rendering away from the cluster's file system)."""
    from qualify.memory import misfits

    if profile.gpu_mem_bytes is None or not profile.gpus_per_node:
        return
    host: dict[str, int | None] = {}
    if profile.mem_mb is not None:
        vllm = max(matrix.rollout.vllm_tp)
        host["reference"] = share(profile, gpus=vllm, procs=vllm, what="reference").mem_mb << 20
        for case in cases:
            host[case.name] = share(profile, gpus=case_gpus(case), procs=case_gpus(case), what=f"case {case.name}").mem_mb << 20
    lines, _ = misfits(matrix, cases, profile.gpu_mem_bytes, host)
    if lines:
        raise SlurmError(f"{len(lines)} stage(s) of {matrix.source} cannot fit {profile.source} "
                         f"(gpu_mem {profile.gpu_mem}): " + "; ".join(lines)
                         + " (choose cases with --cases, a larger TP, reference.offload: host, or another profile)")


def select_cases(cases: list[Case], source: str, pattern: str | None) -> list[Case]:
    """The matrix's cases, or those whose name matches the glob pattern."""
    if pattern is None:
        return cases
    chosen = [c for c in cases if fnmatch.fnmatchcase(c.name, pattern)]
    if not chosen:
        raise SlurmError(f"--cases {pattern!r} matches no case of {source} "
                         f"(cases: {', '.join(c.name for c in cases)})")
    return chosen


def render_chain(matrix_path: Path, profile_path: Path, *, run: Path, out: Path,
                 topology: str | None = None, cases: str | None = None) -> Chain:
    """Render every job of the chain (nothing is written; see write_chain)."""
    matrix, profile = load_matrix(matrix_path), load_profile(profile_path)
    topologies = _topologies(matrix.candidates, matrix.source, topology)
    for label, path in (("matrix", matrix_path), ("run directory", run)):
        if shlex.quote(str(path)) != str(path):
            raise SlurmError(f"{label} path {str(path)!r} needs shell quoting; use a path without spaces or quotes")
    templates = Path(profile.resolve(profile.templates)) if profile.templates else DEFAULT_TEMPLATES
    ctx = _Context(matrix=matrix, profile=profile, templates=templates, run=str(run),
                   matrix_path=str(matrix_path), profile_path=comment_safe(str(profile_path)),
                   matrix_sha256=hashlib.sha256(Path(matrix_path).read_bytes()).hexdigest())
    selected = select_cases(matrix.cases(), matrix.source, cases)
    vllm = max(matrix.rollout.vllm_tp)
    jobs = [ctx.job("reference", "reference", (), (), share(profile, gpus=vllm, procs=vllm, what="reference")),
            ctx.job("freeze", "freeze", ("reference",), (), share(profile, gpus=0, procs=1, what="freeze"))]
    groups: dict[Share, list[str]] = {}
    for case in selected:
        units = case_gpus(case)
        need = share(profile, gpus=units, procs=units, what=f"case {case.name}")
        groups.setdefault(need, []).append(case.name)
    check_memory(matrix, profile, selected)
    for need in sorted(groups, key=lambda s: (s.gpus, s.cpus)):
        key = f"candidate-{need.gpus}gpu" if profile.gpus_per_node else f"candidate-{need.cpus}cpu"
        jobs.append(ctx.job(key, "candidate", ("freeze",), tuple(groups[need]), need))
    arrays = tuple(j.key for j in jobs if j.stage == "candidate")
    only = "" if cases is None else f" --only {shlex.quote(cases)}"
    jobs.append(ctx.job("verdict", "verdict", arrays, (), share(profile, gpus=0, procs=1, what="verdict"), only=only))
    if profile.gpus_per_node:  # GPU topologies mean nothing on a CPU cluster
        jobs += _rounds_jobs(ctx, topologies)
    numbered = tuple(replace(j, file=f"{i}-{j.key}{SCRIPT_SUFFIX}") for i, j in enumerate(jobs, 1))
    return Chain(matrix=matrix, profile=profile, run=str(run), out=Path(out), jobs=numbered)


def write_chain(chain: Chain) -> list[Path]:
    """Write the scripts; other *.sbatch files in the output directory (an older rendering) are removed."""
    if chain.out.exists() and not chain.out.is_dir():
        raise SlurmError(f"--out {chain.out} is a file: the scripts are written into a directory")
    chain.out.mkdir(parents=True, exist_ok=True)
    keep = {j.file for j in chain.jobs}
    for stale in chain.out.glob(f"*{SCRIPT_SUFFIX}"):
        if stale.name not in keep:
            stale.unlink()
    paths = []
    for job in chain.jobs:
        path = chain.out / job.file
        atomic_write_bytes(path, job.text.encode("ascii"))
        paths.append(path)
    return paths


def stale_scripts(chain: Chain, directory: Path) -> list[str]:
    """Script names in directory that differ from this rendering, are missing or are extra ([]: up to date)."""
    want = {j.file: j.text for j in chain.jobs}
    have = {p.name: p.read_text(encoding="ascii") for p in Path(directory).glob(f"*{SCRIPT_SUFFIX}")}
    return sorted(name for name in want.keys() | have.keys() if want.get(name) != have.get(name))


def comment_safe(text: str) -> str:
    """text as it may stand in a script's comment: itself when it is printable ASCII, else its escaped form (a newline
    in a directory name would end the comment and start an #SBATCH directive or a command)."""
    return text if text.isascii() and text.isprintable() else ascii(text)


def fill(template: Path, values: dict[str, str]) -> str:
    """Replace every {{ slot }} of a template file; a slot without a value is an error naming it."""
    text = template.read_text(encoding="ascii")
    unknown = sorted(set(_SLOT.findall(text)) - values.keys())
    if unknown:
        raise SlurmError(f"{template}: unknown slots {unknown} (known: {', '.join(sorted(values))})")
    return _SLOT.sub(lambda m: values[m.group(1)], text)


def _topologies(candidates: Candidates, source: str, topology: str | None) -> tuple[str, ...]:
    allowed = candidates.topologies
    if topology is None:
        return tuple(allowed)
    if topology not in allowed:
        raise SlurmError(f"topology {topology!r} is not in {source}'s candidates.topologies {list(allowed)}")
    return (topology,)


def _rounds_jobs(ctx: _Context, topologies: tuple[str, ...]) -> list[Job]:
    """One rounds job per topology, after freeze (the bound comes from the frozen acceptance). They run one
    after another: every topology's rounds write RUN/rounds/vllm-tp<N>."""
    jobs: list[Job] = []
    for topology in topologies:
        vllm, train, gpus = rounds_gpus(ctx.matrix.rollout.vllm_tp, ctx.matrix.candidates.tp, topology)
        need = share(ctx.profile, gpus=gpus, procs=gpus, what=f"rounds ({topology}: vLLM TP{vllm}, trainer TP{train})")
        after = (jobs[-1].key,) if jobs else ("freeze",)
        jobs.append(ctx.job(f"rounds-{topology}", "rounds", after, (), need,
                            rounds=f"--vllm-tp {vllm} --train-tp {train}", topology=topology))
    return jobs


@dataclass(frozen=True, slots=True)
class _Context:
    """Everything every job of one rendering shares."""

    matrix: Matrix
    profile: Profile
    templates: Path
    run: str
    matrix_path: str
    profile_path: str
    matrix_sha256: str

    def job(self, key: str, stage: str, after: tuple[str, ...], cases: tuple[str, ...], need: Share,
            only: str = "", rounds: str = "", topology: str = "") -> Job:
        name = f"{self.matrix.name}-{key}"
        log = f"{self.run}/slurm/logs/%x-" + ("%A_%a" if cases else "%j") + ".out"
        header = fill(self.templates / "header.sh", {
            "title": _title(stage, name, cases, topology),
            "matrix": self.matrix_path,
            "profile": self.profile_path,
            "matrix_sha256": self.matrix_sha256,
            "directives": self._directives(name, stage, need, log, len(cases)),
            "exports": "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(self.profile.exports.items()))
                       or "# (none)",
            "environment": self._environment(),
            "stage": stage,
        })
        text = fill(self.templates / f"{stage}.sh", {
            "header": header.rstrip("\n"),
            "srun": " ".join(["srun --nodes=1 --ntasks=1", *self.profile.srun_args]),
            "qualify": self.profile.qualify,
            "matrix": self.matrix_path,
            "run": self.run,
            "acceptance": f"{self.run}/acceptance/acceptance.json",
            "cases": "\n".join(f"  {c}" for c in cases),
            "only": only,
            "rounds": rounds,
            "topology": topology,
        })
        return Job(key=key, stage=stage, file="", after=after, cases=cases, log=log, need=need, text=text)

    def _directives(self, name: str, stage: str, need: Share, log: str, num_tasks: int) -> str:
        p = self.profile
        lines = [f"--job-name={name}"]
        lines += [f"--{opt}={val}" for opt, val in (("partition", p.partition), ("account", p.account),
                                                    ("qos", p.qos)) if val is not None]
        lines += ["--nodes=1", "--ntasks=1", f"--cpus-per-task={need.cpus}"]
        if need.gpus:
            lines.append(f"--gres=gpu:{p.gpu_type}:{need.gpus}" if p.gpu_type else f"--gres=gpu:{need.gpus}")
        if need.mem_mb is not None:
            lines.append(f"--mem={need.mem_mb}M")
        # rounds: a vLLM engine plus a trainer, like the reference (profiles have no time.rounds yet)
        time = p.time.reference if stage == "rounds" else getattr(p.time, stage)
        lines += [f"--time={time}", "--requeue", "--open-mode=append", f"--output={log}"]
        if num_tasks:
            limit = f"%{p.max_parallel_tasks}" if p.max_parallel_tasks else ""
            lines.append(f"--array=0-{num_tasks - 1}{limit}")
        lines += list(p.sbatch_args)
        return "\n".join(f"#SBATCH {line}" for line in lines)

    def _environment(self) -> str:
        env = self.profile.environment
        lines = [f"module load {m}" for m in env.modules]
        if env.venv is not None:
            lines.append(f"source {shlex.quote(env.venv)}/bin/activate")
        lines += list(env.setup)
        return "\n".join(lines) or "# (none: the submitting shell's environment)"


def _title(stage: str, name: str, cases: tuple[str, ...], topology: str) -> str:
    if cases:
        return f"{name}: candidate array, {len(cases)} tasks (one per case)"
    return {"reference": f"{name}: vLLM rollout capture, then HF reference scoring with controls",
            "freeze": f"{name}: freeze bounds and the acceptance manifest",
            "verdict": f"{name}: the verdict over every case, then verify the acceptance",
            "rounds": f"{name}: two PPO rounds with live weight installation into vLLM ({topology} GPUs), "
                      "and the rejection probes"}[stage]
