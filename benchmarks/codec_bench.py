"""A case's evidence plain against coded (qualify.tensor_codec), side by side in one run: bytes, write time and the
time to read every gradient, update and moment back (as the judge does), for real AdamW steps of a model-sized set of
parameters.

    python benchmarks/codec_bench.py [--params 50e6] [--steps 1] [--bf16] [--dir /dev/shm/codec-bench] [--device cuda]

The parameters are Qwen3-0.6B-like shapes scaled to --params (an embedding and square and wide matrices, norm
vectors); the gradients are random (bf16 values with --bf16, as a bf16 engine's are); the optimizer is torch's AdamW
with clip_grad_norm_, the case worker's arithmetic (updates = new - start). Prints both and their ratios. "plain" codes
only what is free (bf16-valued gradients in bf16, as every write does); "coded" is a case's full coding.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qualify.compare import GROUPS, load_run, write_step
from qualify.store import tree_bytes, write_json
from qualify.tensor_codec import Adam, StepCoding

OPT = {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "max_grad_norm": 1.0}


def shapes(total: float) -> dict[str, tuple[int, ...]]:
    """0.6B's proportions: the embedding about a quarter, then layers of q/k/v/o and MLP matrices and norms."""
    h = 1024
    vocab = int(total * 0.26 / h)
    out = {"model.embed_tokens.weight": (vocab, h)}
    per_layer = 2 * h * 2 * h + 2 * h * h + 3 * h * 3 * h
    for i in range(max(1, int(total * 0.74 / per_layer))):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (2 * h, h), p + "self_attn.o_proj.weight": (h, 2 * h),
                p + "self_attn.k_proj.weight": (h, h), p + "self_attn.v_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (3 * h, h), p + "mlp.up_proj.weight": (3 * h, h),
                p + "mlp.down_proj.weight": (h, 3 * h), p + "input_layernorm.weight": (h,)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--profile", action="store_true", help="where the coded read's time goes (cProfile)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/codec-bench"))
    ap.add_argument("--device", default="cpu", help="where the coded case is coded and read back (cuda: as a GPU "
                    "case worker codes and the judge reads; the plain case is read there too)")
    a = ap.parse_args()
    on_gpu = a.device != "cpu"
    shutil.rmtree(a.dir, ignore_errors=True)
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for n, s in shapes(a.params).items()}
    numel = sum(p.numel() for p in params.values())
    model = a.dir / "models" / "actor"
    model.mkdir(parents=True)
    save_file({n: p.detach().clone() for n, p in params.items()}, str(model / "model.safetensors"))
    opt = torch.optim.AdamW(params.values(), lr=OPT["lr"], betas=OPT["betas"], eps=OPT["eps"],
                            weight_decay=OPT["weight_decay"], foreach=False)
    records, starts, start = [], [], {n: p.detach().clone() for n, p in params.items()}
    for _ in range(a.steps):
        for p in params.values():
            g = torch.randn(p.shape, generator=gen) * 1e-3
            p.grad = g.bfloat16().float() if a.bf16 else g
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        norm = torch.nn.utils.clip_grad_norm_(params.values(), OPT["max_grad_norm"])
        opt.step()
        new = {n: p.detach().clone() for n, p in params.items()}
        records.append({"outputs": {"grad_norm": norm.detach().float().reshape(())}, "grads": grads,
                        "updates": {n: new[n] - start[n] for n in params},
                        "moments": {f"{key}/{n}": opt.state[p][key].detach().clone()
                                    for key in ("exp_avg", "exp_avg_sq") for n, p in params.items()}})
        starts.append(start)
        start = new
    result = {}
    for label in ("plain", "coded"):
        case = a.dir / "candidates" / label
        t = time.perf_counter()
        startable = None
        for k, step in enumerate(records):
            coding = None if label == "plain" else StepCoding(
                Adam.of(OPT), k, records[k - 1]["moments"] if k else None, starts[k],
                starts[k + 1] if k + 1 < len(starts) else start, model, startable, device=None if not on_gpu else a.device)
            startable = write_step(case / f"step{k}", step, coding=coding)
        if on_gpu:
            torch.cuda.synchronize()
        write_json(case / "meta.json", {"num_steps": len(records)})
        written = time.perf_counter() - t
        t = time.perf_counter()
        if a.profile and label == "coded":
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        for k in range(len(records)):
            run = load_run(case, k)
            for group in GROUPS[1:]:
                files = getattr(run, group)
                for name in files:  # every byte read (a plain file's tensor maps its pages lazily)
                    (files.tensor(name, a.device) if on_gpu else files[name]).sum()
        if on_gpu:
            torch.cuda.synchronize()
        read = time.perf_counter() - t
        if a.profile and label == "coded":
            import pstats
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        size = tree_bytes(case) - sum((case / f"step{k}" / "outputs.safetensors").stat().st_size
                                      for k in range(len(records)))
        result[label] = (size, written, read)
        print(f"{label}: {size / 1e6:.1f} MB ({size / numel / len(records):.3f} bytes per parameter per step), "
              f"write {written:.2f} s, read back {read:.2f} s")
    (ps, pw, pr), (cs, cw, cr) = result["plain"], result["coded"]
    print(f"{numel / 1e6:.1f}M parameters, {a.steps} step(s), {'bf16' if a.bf16 else 'fp32'} gradients, "
          f"{torch.get_num_threads()} threads, {a.device}: coded/plain bytes {cs / ps:.3f}, write {cw / pw:.2f}x, read {cr / pr:.2f}x")
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
