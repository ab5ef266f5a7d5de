"""Megatron engine vs the HF reference on one GPU: tiny Qwen3 and a Qwen3-0.6B-shaped model, TP1.

For each model, role (actor, critic) and precision (fp32, bf16) this runs, on the same GPU and the
same fixed batch and PPO targets: the HF reference (FP32 master, bf16 compute copy under bf16, sdpa,
clip_grad_norm_, torch AdamW, as qualify.reference.step does), an HF control with eager attention
(a numerically legitimate perturbation: its distance to the reference is the control error), and
qualify's MegatronEngine. Per metric it reports the worst tensor's max |megatron - reference|, the
control error and the bound k * control + floor of matrices/tiny-qwen3.yaml.
Usage (one process, launched by torchrun): see benchmarks/megatron_gpu.sh.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from qualify.engines.base import Batch, EngineContext
from qualify.matrix import load_matrix
from qualify.models.hf import scores_from_outputs
from qualify.ppo.math import clipped_policy_loss, clipped_value_loss

MATRIX = Path(__file__).resolve().parents[1] / "matrices" / "tiny-qwen3.yaml"
METRICS = ("score", "loss", "grad_norm", "grad", "update", "moment")
FLOOR_KIND = {"score": "logprob", "loss": "loss", "grad_norm": "grad_norm", "grad": "grad", "update": "update",
              "moment": "moment"}


def qwen3_06b_config(role: str):
    """Qwen3-0.6B's published shape (tied embeddings, 28 layers, GQA 16/8, head_dim 128), random weights."""
    from transformers import Qwen3Config

    extra = {"num_labels": 1, "classifier_dropout": 0.0} if role == "critic" else {}
    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=role == "actor",
                       initializer_range=0.02, attention_dropout=0.0, **extra)


def make_models(out: Path, names: list[str]) -> dict[str, dict[str, Path]]:
    """HF checkpoints: the tiny family from the matrix's seed, and the 0.6B shape from seed 6."""
    from transformers import Qwen3ForCausalLM, Qwen3ForTokenClassification

    from qualify.models.tiny import build_tiny_model

    spec = load_matrix(MATRIX).models.tiny
    dirs: dict[str, dict[str, Path]] = {"tiny-qwen3": {}, "qwen3-0.6b-shape": {}}
    for role in ("actor", "critic"):
        build_tiny_model(spec, role).save_pretrained(out / "tiny-qwen3" / role)
        dirs["tiny-qwen3"][role] = out / "tiny-qwen3" / role
        if "qwen3-0.6b-shape" not in names:
            continue
        torch.manual_seed(6 + (role == "critic"))
        cls = Qwen3ForCausalLM if role == "actor" else Qwen3ForTokenClassification
        model = cls(qwen3_06b_config(role))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.02)
                elif name.startswith("score."):
                    p.normal_(0.0, 0.02)
        model.save_pretrained(out / "qwen3-0.6b-shape" / role)
        dirs["qwen3-0.6b-shape"][role] = out / "qwen3-0.6b-shape" / role
    return dirs


def fixed_batch(vocab: int, rows: int, length: int, seed: int) -> tuple[Batch, dict[str, torch.Tensor]]:
    """Right-padded rows: prompt of length/3, responses of varied length; targets drawn from the seed."""
    g = torch.Generator().manual_seed(seed)
    ids_BT = torch.randint(1, vocab, (rows, length), generator=g)
    mask_BT = torch.zeros(rows, length, dtype=torch.bool)
    for b in range(rows):
        end = length - b * length // (3 * rows)
        mask_BT[b, length // 3:end] = True
        ids_BT[b, end:] = 0
    targets = {"noise_BT": 0.05 * torch.randn(rows, length, generator=g),
               "adv_BT": torch.randn(rows, length, generator=g), "returns_BT": torch.randn(rows, length, generator=g)}
    return Batch(input_ids_BT=ids_BT, response_mask_BT=mask_BT), targets


def loss_of(role: str, scores_BT, batch: Batch, targets, old_BT) -> torch.Tensor:
    m = batch.response_mask_BT
    if role == "actor":
        return clipped_policy_loss(scores_BT * m, old_BT, targets["adv_BT"], m, 0.2, "global", None)[0]
    return clipped_value_loss(scores_BT * m, old_BT, targets["returns_BT"], m, 0.2, "global", None)[0]


def hf_run(model_dir: Path, role: str, precision: str, attn: str, batch: Batch, targets, old_BT, opt, temp, chunk,
           vocab) -> dict:
    """The reference step (qualify.reference.step's scheme) on the GPU."""
    from transformers import Qwen3ForCausalLM, Qwen3ForTokenClassification

    cls = Qwen3ForCausalLM if role == "actor" else Qwen3ForTokenClassification
    master = cls.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation=attn).eval().cuda()
    model = master if precision == "fp32" else copy.deepcopy(master).to(torch.bfloat16)
    ids_BT = batch.input_ids_BT.cuda()
    scores_BT = scores_from_outputs(role, model(input_ids=ids_BT, use_cache=False).logits, ids_BT, temp, chunk,
                                  vocab).cpu()
    loss = loss_of(role, scores_BT, batch, targets, old_BT)
    loss.backward()
    names = [n for n, _ in master.named_parameters()]
    for (_, mp), (_, cp) in zip(master.named_parameters(), model.named_parameters(), strict=True):
        if cp is not mp:
            mp.grad = cp.grad.float()
    grads = {n: p.grad.detach().cpu().clone() for n, p in master.named_parameters()}
    before = {n: p.detach().cpu().clone() for n, p in master.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(list(master.parameters()), opt.max_grad_norm, foreach=False)
    adam = torch.optim.AdamW(master.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps,
                             weight_decay=opt.weight_decay, foreach=False)
    adam.step()
    params = dict(master.named_parameters())
    return {"score": scores_BT.detach() * batch.response_mask_BT, "loss": loss.detach(), "grad_norm": norm.cpu(),
            "grad": grads, "update": {n: params[n].detach().cpu() - before[n] for n in names},
            "moment": {n: adam.state[params[n]]["exp_avg"].cpu() for n in names}}


def megatron_run(model_dir: Path, role: str, precision: str, batch: Batch, targets, old_BT, opt, temp, chunk,
                 vocab, work: Path) -> dict:
    from qualify.engines.megatron import MegatronEngine
    from qualify.models.checkpoint import checkpoint_tensors

    engine = MegatronEngine()
    engine.setup(EngineContext(role=role, precision=precision, tp=1, rank=0, device="cuda:0", model_dir=model_dir,
                               optimizer=opt, temperature=temp, logprob_chunk_tokens=chunk, vocab_size=vocab,
                               work_dir=work))
    scores_BT = engine.score(batch)
    loss = loss_of(role, scores_BT, batch, targets, old_BT)
    engine.backward(loss)
    grads = engine.grads()
    norm = engine.step()
    params, state = engine.params(), engine.optimizer_state()
    grad_dtypes = set(engine.grad_dtypes().values())
    engine.close()
    before = {n: t.float() for n, t in checkpoint_tensors(model_dir).items() if n in params}
    return {"score": scores_BT.detach() * batch.response_mask_BT, "loss": loss.detach(), "grad_norm": norm,
            "grad": grads, "update": {n: params[n] - before[n] for n in params}, "moment": state["exp_avg"],
            "grad_dtypes": sorted(grad_dtypes), "notes": engine.notes}


def distance(a: dict, b: dict) -> dict[str, float]:
    """Per metric, the worst tensor's max |a - b| (names must agree)."""
    out = {}
    for metric in METRICS:
        x, y = a[metric], b[metric]
        if isinstance(x, dict):
            assert set(x) == set(y), sorted(set(x) ^ set(y))[:5]
            out[metric] = max(float((x[n].float() - y[n].float()).abs().max()) for n in x)
        else:
            out[metric] = float((x.float() - y.float()).abs().max())
    return out


def flips(a: dict, b: dict, lr: float) -> float:
    """Fraction of update elements that differ by more than lr (Adam's first-step sign flips are 2 lr)."""
    over = sum(int(((a["update"][n] - b["update"][n]).abs() > lr).sum()) for n in a["update"])
    return over / sum(t.numel() for t in a["update"].values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/megatron_gpu_work"), help="checkpoints (GBs)")
    parser.add_argument("--models", default="tiny-qwen3,qwen3-0.6b-shape")
    args = parser.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.cuda.set_device(0)
    matrix = load_matrix(MATRIX)
    opt, temp, chunk = matrix.optimizer, matrix.rollout.temperature, matrix.reference.logprob_chunk_tokens
    work = args.work
    args.out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    names = args.models.split(",")
    dirs = make_models(work, names)
    print(f"models made in {time.monotonic() - started:.1f} s", flush=True)
    shapes = {"tiny-qwen3": (8, 40), "qwen3-0.6b-shape": (4, 256)}
    rows = []
    for model_name in names:
        for role in ("actor", "critic"):
            model_dir = dirs[model_name][role]
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
            batch, targets = fixed_batch(vocab, *shapes[model_name], seed=1234)
            # Targets anchored on the fp32 reference's own scores, so ratios sit near 1 and clipping is exercised.
            base = hf_run(model_dir, role, "fp32", "sdpa", batch, targets, torch.zeros(batch.input_ids_BT.shape), opt,
                          temp, chunk, vocab)
            old_BT = (base["score"] + targets["noise_BT"]) * batch.response_mask_BT
            for precision in ("fp32", "bf16"):
                t0 = time.monotonic()
                ref = hf_run(model_dir, role, precision, "sdpa", batch, targets, old_BT, opt, temp, chunk, vocab)
                control = hf_run(model_dir, role, precision, "eager", batch, targets, old_BT, opt, temp, chunk, vocab)
                t1 = time.monotonic()
                meg = megatron_run(model_dir, role, precision, batch, targets, old_BT, opt, temp, chunk, vocab, work)
                t2 = time.monotonic()
                rows.append(judge(model_name, role, precision, ref, control, meg, matrix, t1 - t0, t2 - t1))
                print(json.dumps(rows[-1]), flush=True)
    summary(rows)
    print(f"total {time.monotonic() - started:.1f} s", flush=True)
    (args.out / "megatron_gpu.json").write_text(json.dumps({"rows": rows, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                                            "torch": torch.__version__}, indent=1))
    dist.destroy_process_group()


def judge(model_name, role, precision, ref, control, meg, matrix, hf_s, meg_s) -> dict:
    err, ctl = distance(meg, ref), distance(control, ref)
    floors, k = matrix.freeze.floors, matrix.freeze.k
    bound = {m: k * ctl[m] + floors[FLOOR_KIND[m] if m != "score" or role == "actor" else "value"] for m in METRICS}
    return {"model": model_name, "role": role, "precision": precision, "megatron_vs_ref": err, "control": ctl,
            "bound": bound, "within": {m: err[m] <= bound[m] for m in METRICS},
            "update_flip_frac": {"megatron": flips(meg, ref, matrix.optimizer.lr),
                                 "control": flips(control, ref, matrix.optimizer.lr)},
            "grad_dtypes": meg["grad_dtypes"], "notes": meg["notes"][:2],
            "seconds": {"hf_ref_and_control": round(hf_s, 2), "megatron": round(meg_s, 2)}}


def summary(rows: list[dict]) -> None:
    print("\nmodel              role    prec  " + "  ".join(f"{m:>21}" for m in METRICS))
    for r in rows:
        cells = [f"{r['megatron_vs_ref'][m]:.1e}/{r['bound'][m]:.1e}{'' if r['within'][m] else '!'}" for m in METRICS]
        print(f"{r['model']:<18} {r['role']:<7} {r['precision']:<5} " + "  ".join(f"{c:>21}" for c in cells))
    print("cells: max |megatron - HF reference| / bound (k x eager-attention control + floor); '!' = over the bound")


if __name__ == "__main__":
    main()
