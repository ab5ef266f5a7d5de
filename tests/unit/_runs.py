"""Small real evidence for unit tests: AdamW runs, and a sealed synthetic reference run directory.

Everything is written with qualify's own store and stage helpers, so a test can freeze it, judge
against it and tamper with it the way a real run directory would be tampered with. The runs of a
synthetic reference differ from the fp32 r0 run by a known multiple of one noise tensor
(COEF), so every control error is non-zero and each family's largest one comes from a known run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import yaml

from qualify.compare import RunTensors
from qualify.layout import RunLayout
from qualify.matrix import Matrix, Optimizer, load_matrix
from qualify.roles import MODEL_ROLES
from qualify.schema import to_dict
from qualify.stages import complete_stage, prepare_stage
from qualify.store import write_json, write_tensors

REPO = Path(__file__).resolve().parents[2]
OPT = Optimizer(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, max_grad_norm=0.5)
CONTROLS = ["r0", "r1", "r2"]
# run (precision, control) = fp32 r0 + COEF * noise. Largest control error per family: fp32-repeat from
# fp32-r1 (1e-4, not r2's 3e-5), bf16-repeat from bf16-r1 (|1e-4 - 3e-4|, not r2's 1e-4), fp32-vs-bf16
# from bf16-r0 (3e-4, not r2's 2e-4).
COEF = {("fp32", "r0"): 0.0, ("fp32", "r1"): 1e-4, ("fp32", "r2"): 3e-5,
        ("bf16", "r0"): 3e-4, ("bf16", "r1"): 1e-4, ("bf16", "r2"): 2e-4}
# k and floors unlike the defaults, one distinct floor per kind: a bound built with the wrong k or kind shows.
K = 3.0
FLOORS = {"logprob": 1e-6, "value": 2e-6, "loss": 3e-6, "grad": 4e-6, "grad_norm": 5e-6, "update": 6e-6,
          "target": 8e-6, "relative": 9e-6}
OUTPUT_NAMES = {"actor": "logprobs_BT", "critic": "values_BT"}


def adamw_run(params: dict, grads: dict, opt: Optimizer = OPT) -> tuple[dict, dict]:
    """One torch AdamW step from params with the given grads: (updates, moments)."""
    live = {n: torch.nn.Parameter(p.clone()) for n, p in params.items()}
    for n, p in live.items():
        p.grad = grads[n].clone()
    o = torch.optim.AdamW(live.values(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
                          foreach=False)
    o.step()
    updates = {n: p.detach() - params[n] for n, p in live.items()}
    moments = {f"{k}/{n}": o.state[p][k] for n, p in live.items() for k in ("exp_avg", "exp_avg_sq")}
    return updates, moments


def params() -> dict[str, torch.Tensor]:
    """The parameters every synthetic run starts from (its 'checkpoint')."""
    return {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(99)) * 0.5, "b": torch.ones(3)}


def _noise(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def role_run(role: str, coef: float) -> RunTensors:
    """One role's evidence: the base run plus coef * noise on outputs and gradients; AdamW makes the rest."""
    p = params()
    grads = {n: _noise(1 + i, t.shape) * 1e-2 for i, (n, t) in enumerate(p.items())}
    for i, (n, g) in enumerate(grads.items()):
        g.view(-1)[0] = 0.0  # an element without gradient: its update sign is noise, never resolved by fp32 r0
        g += coef * _noise(11 + i, g.shape)
    updates, moments = adamw_run(p, grads)
    outputs = {OUTPUT_NAMES[role]: _noise(5, (2, 5)) + coef * _noise(15, (2, 5)),
               "loss": torch.tensor(0.5) + coef, "grad_norm": torch.tensor(0.25) + 2 * coef}
    return RunTensors(outputs, grads, updates, moments)


def role_steps(role: str, coef: float, num_steps: int) -> list[RunTensors]:
    """num_steps torch AdamW steps of one role from params(): step k's gradients are role_run's, scaled by 1 + k."""
    p0 = params()
    live = {n: torch.nn.Parameter(p.clone()) for n, p in p0.items()}
    opt = torch.optim.AdamW(live.values(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay,
                            foreach=False)
    first = role_run(role, coef)
    steps = []
    for k in range(num_steps):
        before = {n: p.detach().clone() for n, p in live.items()}
        grads = {n: g * (1 + k) for n, g in first.grads.items()}
        for n, p in live.items():
            p.grad = grads[n].clone()
        opt.step()
        steps.append(RunTensors({n: t + k for n, t in first.outputs.items()}, grads,
                                {n: p.detach() - before[n] for n, p in live.items()},
                                {f"{m}/{n}": opt.state[p][m].clone() for n, p in live.items()
                                 for m in ("exp_avg", "exp_avg_sq")}))
    return steps


def write_steps(directory: Path, steps: list[RunTensors], meta: dict | None = None) -> None:
    """Seal a multi-step role directory: step<k>/ per step, meta.json with num_steps."""
    prepare_stage(directory)
    for k, run in enumerate(steps):
        for group in ("outputs", "grads", "updates", "moments"):
            write_tensors(directory / f"step{k}" / f"{group}.safetensors", getattr(run, group))
    write_json(directory / "meta.json", {"num_steps": len(steps), **(meta or {})})
    complete_stage(directory, meta or {})


def write_run(directory: Path, run: RunTensors, meta: dict | None = None) -> None:
    """Seal a one-step run directory as the reference and the candidate stages do.

    The tensors go both into the directory and into its step0/ (the multi-step layout, meta num_steps 1),
    so the same evidence reads as one step whichever layout the reader expects.
    """
    prepare_stage(directory)
    for where in (directory, directory / "step0"):
        for group in ("outputs", "grads", "updates", "moments"):
            write_tensors(where / f"{group}.safetensors", getattr(run, group))
    write_json(directory / "meta.json", {"num_steps": 1, **(meta or {})})
    complete_stage(directory, meta or {})


def unstep(bounds: dict) -> dict:
    """Bound keys of a one-step run without their 'step0/' prefix (where the bound file has one)."""
    return {key.removeprefix("step0/"): b for key, b in bounds.items()}


def sealed_file_stage(directory: Path, name: str, tensors: dict[str, torch.Tensor], info: dict | None = None) -> str:
    """A sealed stage holding one safetensors file; returns the file's 'sha256:...' digest."""
    prepare_stage(directory)
    write_tensors(directory / name, tensors)
    digest = "sha256:" + hashlib.sha256((directory / name).read_bytes()).hexdigest()
    complete_stage(directory, {"digest": digest, **(info or {})})
    return digest


def rollout_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[:, 3:] = True
    return {"input_ids_BT": torch.randint(1, 64, (2, 6), generator=g), "prompt_mask_BT": ~mask,
            "response_mask_BT": mask, "sampler_logprobs_BT": -torch.rand(2, 6, generator=g)}


def synthetic_matrix(tmp_path: Path, require: tuple[str, ...] = ()) -> Matrix:
    """The embedded default's matrix with K and FLOORS as its freeze rule, OPT as its optimizer and CONTROLS (repeats
    only) as its controls."""
    data = yaml.safe_load((REPO / "matrices" / "tiny-qwen3.yaml").read_text())
    data["freeze"] = {"k": K, "floors": FLOORS, "require": list(require)}
    data["reference"] |= {"repeats": len(CONTROLS), "perturbations": []}  # the controls the synthetic runs are
    data["optimizer"] = {"lr": OPT.lr, "betas": list(OPT.betas), "eps": OPT.eps, "weight_decay": OPT.weight_decay,
                         "max_grad_norm": OPT.max_grad_norm}  # the optimizer that made the runs
    path = tmp_path / "synthetic.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_matrix(path)


def synthetic_reference(run_dir: Path, matrix: Matrix, coverage: dict | None = None) -> RunLayout:
    """A complete, sealed reference (no vLLM, no model): snapshot, models, rollouts, targets, scores, summary.

    coverage: per role, the branch counts of each step, recorded in the fp32 r0 scores' meta.json.
    """
    layout = RunLayout(Path(run_dir))
    prepare_stage(layout.matrix_snapshot)
    write_json(layout.matrix_snapshot / "matrix.json", to_dict(matrix))
    matrix_digest = "sha256:" + hashlib.sha256((layout.matrix_snapshot / "matrix.json").read_bytes()).hexdigest()
    complete_stage(layout.matrix_snapshot, {"digest": matrix_digest})
    for role in MODEL_ROLES:
        sealed_file_stage(layout.model(role), "model.safetensors", params())
    digests = {tp: sealed_file_stage(layout.rollout(tp), "rollout.safetensors", rollout_tensors(tp))
               for tp in matrix.rollout.vllm_tp}  # each TP degree its own digest: the primary one is the first
    targets = sealed_file_stage(layout.targets, "targets.safetensors", {"advantages_BT": torch.ones(2, 6)})
    for (precision, control), coef in COEF.items():
        for role in ("actor", "critic"):
            cov = (coverage or {}).get(role) if (precision, control) == ("fp32", "r0") else None
            write_run(layout.scores(precision, control, role), role_run(role, coef),
                      {"precision": precision, "control": control, "role": role}
                      | ({"coverage": cov} if cov is not None else {}))
    write_json(layout.reference_summary, {
        "matrix": to_dict(matrix), "matrix_digest": matrix_digest, "controls": CONTROLS,
        "rollout_digest": digests[matrix.rollout.vllm_tp[0]], "targets_digest": targets,
        "versions": {"torch": torch.__version__}, "host": {"name": "unit"}, "git": {"commit": None, "dirty": None},
        "platform": {"cpu": "unit"}, "rollout_platform": {"cpu": "capture"}})
    return layout


def eager_starts(steps, initial):
    """Each step's start parameters computed eagerly, all at once (fp64 initial + that run's earlier updates): the
    expected values for qualify.compare.StepStarts, sharing none of its code."""
    current = {n: t.double() for n, t in initial.items()}
    out = []
    for run in steps:
        out.append(current)
        current = {n: t + run.updates[n].double() if n in run.updates and run.updates[n].shape == t.shape else t
                   for n, t in current.items()}
    return out
