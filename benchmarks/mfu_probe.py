"""Where the reference's bf16 scoring step spends its GPU time (what limits its MFU).

Times forward+backward of the actor on a run's rollout (qualify.reference.step's own compute model and loss, as
benchmarks/scale_probe.py does), then profiles one more with torch.profiler and sums CUDA kernel time by kind:
matrix multiplications (GEMM), attention, the fp32 sampler formula (log_softmax, logsumexp, gather and their
backward), the rest. MFU = 6 x params x tokens / wall / BF16_PEAK. Prints one JSON document (and writes OUT_JSON).

On --device cpu (to try the probe without a GPU) the kinds sum the CPU operators' own times instead.

Usage: python benchmarks/mfu_probe.py MATRIX RUN_DIR OUT_JSON [--rollout DIR] [--precision bf16] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_probe import BF16_PEAK, configured, synthetic_targets, time_forward_backward

KINDS = (("gemm", ("gemm", "cutlass", "sm90_xmma", "cublas", "nvjet", "matmul", "ampere_", "hopper", "aten::mm", "aten::addmm", "aten::bmm")),
         ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
         ("sampler formula", ("softmax", "logsumexp", "log_softmax", "gather", "scatter")),
         ("reduction", ("reduce",)),
         ("copy and cast", ("copy", "cast", "to_copy", "fill")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "elementwise and other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("matrix")
    ap.add_argument("run")
    ap.add_argument("out")
    ap.add_argument("--rollout")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    import scale_probe

    scale_probe.DEVICE = args.device
    cuda = args.device == "cuda"

    from qualify.matrix import load_matrix
    from qualify.memory import matrix_shapes
    from qualify.models.hf import load_model
    from qualify.reference.step import Control, _compute_model, _forward_backward
    from qualify.rollout.capture import load_rollout

    base = load_matrix(args.matrix)
    precision, ctx = configured(base, args.precision, args.run)
    model_dir = Path(args.run) / "reference" / "models" / "actor"
    rollouts = Path(args.rollout) if args.rollout else Path(args.run) / "reference" / "rollout"
    rollout = load_rollout(rollouts / f"tp{base.rollout.vllm_tp[0]}")
    batch = {"input_ids_BT": rollout["input_ids_BT"], "response_mask_BT": rollout["response_mask_BT"]}
    targets = synthetic_targets(batch["response_mask_BT"])
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokens, params = int(batch["input_ids_BT"].numel()), matrix_shapes(base.models, base.resolve)["actor"].params
    wall = time_forward_backward(ctx, precision, load_model(model_dir, "actor"), batch, targets, vocab, model_dir)

    device = torch.device(args.device)
    model = _compute_model(load_model(model_dir, "actor").to(device), precision, model_dir, "actor", "sdpa", device,
                           False)
    b = {k: v.to(device) for k, v in batch.items()}
    t = {k: v.to(device) for k, v in targets.items()}
    _forward_backward(ctx, "actor", Control(name="r0"), model, b, t, vocab)  # warm
    model.zero_grad(set_to_none=True)
    scale_probe.sync()
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        _forward_backward(ctx, "actor", Control(name="r0"), model, b, t, vocab)
        scale_probe.sync()
    by_kind: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        # kernels do not nest; CPU operators do, so on the CPU each one's own time
        us = (getattr(e, "device_time_total", None) or e.cuda_time_total) if cuda else e.self_cpu_time_total
        by_kind[kind_of(e.name)] += us
        by_kernel[e.name][0] += us
        by_kernel[e.name][1] += 1
    busy = sum(by_kind.values()) / 1e6
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:15]
    doc = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__, "precision": precision,
           "tokens": tokens, "params": params, "fwd_bwd_s": round(wall, 4),
           "mfu_vs_bf16_peak": round(6 * params * tokens / wall / BF16_PEAK, 4),
           "gpu_busy_s": round(busy, 4), "gpu_busy_share_of_wall": round(busy / wall, 3),
           "kernels": sum(n for _, n in by_kernel.values()),
           "by_kind_s": {k: round(v / 1e6, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
           "top_kernels": [{"name": n[:90], "s": round(v[0] / 1e6, 4), "calls": v[1]} for n, v in top]}
    print(json.dumps(doc, indent=1))
    Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
