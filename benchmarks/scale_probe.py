"""The HF reference at a real shape on one GPU: peak GPU memory, time and MFU of its step, on-device vs
reference.offload: host, each against qualify.memory's estimate; and whether offload changes any evidence bit.

Runs qualify.reference.step.run_role itself (the code `qualify reference` runs) on the actor of a run directory,
with the run's rollout rows and synthetic PPO targets (timing and memory do not depend on their values), then
times forward+backward alone (three repeats after a warm-up) for tokens/s and MFU = 6 x params x tokens / s
against BF16_PEAK. Prints one JSON document (and writes it to OUT_JSON).

Usage: python benchmarks/scale_probe.py MATRIX RUN_DIR OUT_JSON [--rollout DIR] [--configs fp32,bf16,fp32-host,bf16-host,bf16-ckpt]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

BF16_PEAK = 790e12  # H200 dense bf16, FLOP/s (the device notes' figure)


def synthetic_targets(mask_BT: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, T = mask_BT.shape
    return {"old_logprobs_BT": -torch.rand(B, T, generator=g) * 8, "ref_logprobs_BT": -torch.rand(B, T, generator=g) * 8,
            "advantages_BT": torch.randn(B, T, generator=g), "returns_BT": torch.randn(B, T, generator=g),
            "old_values_BT": torch.randn(B, T, generator=g)}


DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def configured(matrix, config: str, run: Path):
    """(precision, the scoring context of config: matrix's reference on DEVICE, offloaded or checkpointed as it
    says) for run's models."""
    from qualify.layout import RunLayout
    from qualify.reference.context import ScoringContext

    precision, *flags = config.split("-")
    ref = dataclasses.replace(matrix.reference, device=DEVICE, offload="host" if "host" in flags else None,
                              gradient_checkpointing="ckpt" in flags)
    return precision, ScoringContext.of(dataclasses.replace(matrix, reference=ref), RunLayout(Path(run)), "probe", "")


def time_forward_backward(ctx, precision: str, master, batch, targets, vocab: int, model_dir: Path,
                          repeats: int = 3) -> float:
    """Median seconds of one forward+backward of the whole batch in the compute copy on the GPU."""
    from qualify.reference.step import Control, _compute_model, _forward_backward

    device = torch.device(DEVICE)
    offload = ctx.reference.offload == "host"
    if not offload:
        master.to(device)
    model = _compute_model(master, precision, model_dir, "actor", "sdpa", device, offload)
    if ctx.reference.gradient_checkpointing:
        from qualify.models.hf import enable_checkpointing

        enable_checkpointing(model)
    b = {k: v.to(device) for k, v in batch.items()}
    t = {k: v.to(device) for k, v in targets.items()}
    times = []
    for i in range(repeats + 1):
        sync()
        start = time.perf_counter()
        _forward_backward(ctx, "actor", Control(name="r0"), model, b, t, vocab)
        sync()
        if i:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    del model
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("matrix")
    ap.add_argument("run")
    ap.add_argument("out")
    ap.add_argument("--configs", default="fp32,fp32-host,bf16,bf16-host,bf16-ckpt")
    ap.add_argument("--rollout", help="a sealed rollouts directory (DIR/tp<N>) instead of RUN_DIR/reference/rollout")
    ap.add_argument("--device", default="cuda", help="cpu: try the probe itself without a GPU")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    cuda = DEVICE == "cuda"

    from qualify.matrix import load_matrix
    from qualify.memory import GiB, Workload, matrix_shapes, reference_needs
    from qualify.models.hf import load_model
    from qualify.reference.step import Control, run_role
    from qualify.rollout.capture import load_rollout

    base = load_matrix(args.matrix)
    model_dir = Path(args.run) / "reference" / "models" / "actor"
    for _ in range(600):  # the reference stage next door writes the models first
        if (model_dir / "_complete.json").is_file():
            break
        time.sleep(1)
    rollouts = Path(args.rollout) if args.rollout else Path(args.run) / "reference" / "rollout"
    rollout = load_rollout(rollouts / f"tp{base.rollout.vllm_tp[0]}")
    batch = {"input_ids_BT": rollout["input_ids_BT"], "response_mask_BT": rollout["response_mask_BT"]}
    targets = synthetic_targets(batch["response_mask_BT"])
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokens = int(batch["input_ids_BT"].numel())
    shapes = matrix_shapes(base.models, base.resolve)
    params = shapes["actor"].params
    doc = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__, "params": params, "tokens": tokens,
           "batch": list(batch["input_ids_BT"].shape), "configs": {}}
    kept = {}
    for config in args.configs.split(","):
        precision, ctx = configured(base, config, args.run)
        work = Workload.of(base.rollout, base.objective.ppo, ctx.reference)
        estimate = next(n for n in reference_needs(ctx.reference, work, shapes) if f" {precision} actor" in n.what)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        master = load_model(model_dir, "actor")
        t1 = time.perf_counter()
        with torch.enable_grad():
            result = run_role(ctx, "actor", precision, Control(name="r0"), master, batch, targets, vocab, model_dir)
        sync()
        t2 = time.perf_counter()
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        del master
        if cuda:
            torch.cuda.empty_cache()
        fb = time_forward_backward(ctx, precision, load_model(model_dir, "actor"), batch, targets, vocab, model_dir)
        flops = 6 * params * tokens
        row = {"load_s": round(t1 - t0, 2), "run_role_s": round(t2 - t1, 2), "peak_alloc_gib": round(peak / GiB, 2),
               "estimate_gib": round(estimate.gpu_bytes / GiB, 2),
               "estimate_parts_gib": {k: round(v / GiB, 2) for k, v in estimate.parts.items()},
               "fwd_bwd_s": round(fb, 4), "tokens_per_s": round(tokens / fb), "mfu_vs_bf16_peak": round(flops / fb / BF16_PEAK, 4),
               "evidence_bytes_per_step": sum(t.numel() * t.element_size() for g in ("grads", "updates", "moments")
                                              for t in result["steps"][0][g].values())}
        doc["configs"][config] = row
        print(config, json.dumps(row), flush=True)
        if precision in ("fp32", "bf16") and "ckpt" not in config:
            kept[config] = result["steps"][0]
        for plain in ("fp32", "bf16"):
            host = f"{plain}-host"
            if plain in kept and host in kept and f"{plain}_vs_host" not in doc:
                doc[f"{plain}_vs_host"] = compare(kept.pop(plain), kept.pop(host))
                print(f"{plain} on-device vs offload:", json.dumps(doc[f"{plain}_vs_host"]), flush=True)
        del result
    Path(args.out).write_text(json.dumps(doc, indent=1, sort_keys=True))


def compare(a: dict, b: dict) -> dict:
    """Tensors not bitwise equal and the largest |difference| per group (offload's AdamW and clip run on the CPU)."""
    out = {}
    for group in ("outputs", "grads", "updates", "moments"):
        differ, worst = 0, 0.0
        for name, x in a[group].items():
            y = b[group][name]
            if not torch.equal(x, y):
                differ += 1
                worst = max(worst, float((x.double() - y.double()).abs().max()))
        out[group] = {"tensors": len(a[group]), "not_bitwise": differ, "max_abs": worst}
    return out


if __name__ == "__main__":
    sys.exit(main())
