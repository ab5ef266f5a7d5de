"""One reference control: K optimizer steps (forward, PPO loss, backward, clip, AdamW) for actor or critic.

BF16 runs the forward and backward in a bf16 copy of the model; its gradients are cast to FP32
into the FP32 master parameters, which are clipped and stepped by torch.optim.AdamW (the FP32
master-weight scheme that Megatron and DeepSpeed use). FP32 runs everything on the master.
A micro-batch control splits the rows in two and accumulates gradients; each micro-batch's loss is its share of the
step's (the step's normalizers, qualify.ppo.share, as a candidate's DP rank computes it), so the shares sum to the
full-batch loss for every token normalizer and aggregation. The packed control packs each step's rows into
micro-batches of whole samples (qualify.case.packing), scores them packed and accumulates alike.

Forward and backward run on reference.device (auto: CUDA when present). With reference.offload: host
the FP32 master, its gradients and the AdamW state stay in host memory and only the compute copy (an
fp32 one under fp32) is on the device: the GPU then holds the compute weights, their gradients and the
activations, which is what lets one GPU score a model whose optimizer state it could not hold. The
evidence of every step is copied to the host as soon as it exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qualify.case.context import PackedBatch
from qualify.case.packing import pack_rows, plan_packs, sample_lengths, unpack, zero_sample_starts
from qualify.matrix import Reference
from qualify.models.hf import ActorScores, actor_scores, compute_copy, critic_values, enable_checkpointing
from qualify.models.hooks import capture_layer_outputs
from qualify.models.routing import replayed_routes, router_outputs, routing
from qualify.ppo.formula import PROCESSED_KEY, rollout_sampling
from qualify.ppo.math import kl_terms, masked_mean
from qualify.ppo.objective import DECIDED_KEY, GRPOShare, grpo_share, ppo_share, role_objective, rows_of, step_rows
from qualify.reference.tp_numerics import fuse_norms, fuse_projections, split_like_tp

if TYPE_CHECKING:
    from qualify.reference.context import ScoringContext

CONTROL_ATTN = {"attn_impl": "eager"}
BASE_ATTN = "sdpa"


@dataclass(frozen=True, slots=True)
class Control:
    """One independent reference run: a repeat or a numerically legitimate perturbation."""

    name: str
    """r0, r1, ... for repeats; the perturbation's name otherwise."""
    microbatches: int = 1
    reverse_rows: bool = False
    attn_impl: str = BASE_ATTN
    tp: int = 1
    """> 1: linears computed with this TP degree's reduction orders (qualify.reference.tp_numerics)."""
    fused: bool = False
    """q/k/v and gate/up projections computed as one GEMM each (qualify.reference.tp_numerics.fuse_projections)."""
    adam_form: str = "torch"
    """The AdamW the control steps: 'torch' (torch.optim.AdamW), 'reordered' (its arithmetic in another order) or
    'fused' (FusedAdam's form: decay folded in, the parameter rounded once): qualify.reference.adam_order."""
    fused_norm: bool = False
    """Each RMSNorm as one fused kernel, F.rms_norm (qualify.reference.tp_numerics.fuse_norms)."""
    pack_tokens: int | None = None
    """Set: each step's rows packed into micro-batches of at most this many tokens, as a packed case trains
    (qualify.case.packing; the micro-batches then replace microbatches' split)."""


def controls_of(ref: Reference, candidate_tp: tuple[int, ...], pack_tokens: int | None = None) -> list[Control]:
    """The repeats and perturbations the reference section declares, in order (r0 first: the reference itself); the
    tp_split and combined controls split as the candidates' TP degrees do, the packed one packs pack_tokens
    (candidates.pack_tokens) per micro-batch."""
    out = [Control(name=f"r{i}") for i in range(ref.repeats)]
    for p in ref.perturbations:
        if p == "tp_split":
            out += [Control(name=f"tp{n}_split", tp=n) for n in sorted(candidate_tp) if n > 1]
        elif p == "combined":
            out.append(combined_control(ref.perturbations, max(candidate_tp), pack_tokens))
        elif p == "packed":
            assert pack_tokens is not None, "the matrix requires candidates.pack_tokens with the packed control"
            out.append(Control(name=p, pack_tokens=pack_tokens))
        else:
            out.append(Control(name=p, **_PERTURB[p]))
    return out


_PERTURB: dict[str, dict[str, Any]] = {
    "microbatch_split": {"microbatches": 2}, "batch_order": {"reverse_rows": True},
    "attn_impl": {"attn_impl": CONTROL_ATTN["attn_impl"]}, "fused_projections": {"fused": True},
    "optimizer_order": {"adam_form": "reordered"}, "fused_adam": {"adam_form": "fused"},
    "fused_norm": {"fused_norm": True}}


def combined_control(perturbations: tuple[str, ...], max_tp: int, pack_tokens: int | None = None) -> Control:
    """The `combined` control: every other listed perturbation at once (tp_split at max_tp, the largest candidate
    degree; of two optimizer forms, the one listed last; packed: the packed micro-batches instead of
    microbatch_split's). A correct engine differs from the reference in several legitimate ways together (its own
    reduction orders, optimizer, attention kernel, micro-batching); each single control samples one of them, this one
    their sum."""
    settings: dict[str, Any] = {}
    for p in perturbations:
        if p == "tp_split":
            settings["tp"] = max_tp
        elif p == "packed":
            settings["pack_tokens"] = pack_tokens
        elif p != "combined":
            settings |= _PERTURB[p]
    return Control(name="combined", **settings)


def _row_slices(B: int, n: int) -> list[slice]:
    step = -(-B // n)
    return [slice(i, min(i + step, B)) for i in range(0, B, step)]


def reference_device(reference: Reference) -> torch.device:
    """Where the reference's forward and backward run: reference.device, auto = CUDA when present (the cases' too:
    qualify.case.ranks.device_of)."""
    from qualify.case.ranks import device_of

    return torch.device(device_of(reference))


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s clipping (coefficient max_norm / (norm + 1e-6) in fp32, at most 1, every
    gradient scaled in place) with the total norm accumulated in float64 and returned in fp32. torch's fp32
    vector_norm on the CPU adds serially: 6e-4 off at 16M elements of N(0, 1), 2% at 155M (what an offloaded
    reference's norm would be at Qwen3 shapes); the reference is the accurate computation cases are judged against,
    and a case's own norm is held to the fp64 norm of its gradients (qualify.judge.derived)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    total = torch.stack([g.detach().double().square().sum().to(grads[0].device) for g in grads]).sum().sqrt()
    total = total.to(torch.float32)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.device))
    return total


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of t (a copy even when t is already on the host: the step goes on changing it)."""
    return t.detach().to("cpu", copy=True)


def _kept(t: torch.Tensor) -> torch.Tensor:
    """A copy of t where it is (the step goes on changing it)."""
    return t.detach().clone()


def _compute_model(master: torch.nn.Module, precision: str, model_dir: Path, role: str, attn_impl: str,
                   device: torch.device, offload: bool) -> torch.nn.Module:
    """The module forward and backward run in, on device: the master itself in fp32 unless the master is offloaded
    (then a separate fp32 copy holding the master's values), the bf16 copy otherwise."""
    if offload and precision == "fp32":
        from qualify.models.hf import load_model

        model = load_model(model_dir, role, attn_impl)
        with torch.no_grad():
            for mp, cp in zip(master.parameters(), model.parameters()):
                cp.copy_(mp)
    else:
        model = compute_copy(master, precision, model_dir, role, attn_impl)
    return model.to(device)


def run_role(ctx: ScoringContext, role: str, precision: str, control: Control, master: torch.nn.Module,
             batch: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], vocab_size: int,
             model_dir: Path, decided: list[torch.Tensor] | None = None, keep_on_device: bool = False) -> dict[str, Any]:
    """K = epochs x minibatches optimizer steps on master; returns {'steps': [per-step tensors], 'meta': ...,
    'layers': step 1's per-layer activations (qualify.models.hooks)}. decided[k] (bool, the step's rows) imposes
    step k's clip decisions (qualify.reference.forced). keep_on_device: each step's gradients, updates and moments
    are kept where the step made them (a control measured there and kept as a summary: copied to the host and back
    for nothing), else copied to the host; the outputs always are.

    One AdamW instance lives across the steps (its step count, bias correction and moments carry
    over); after each step the compute copy is refreshed from the stepped FP32 master.
    """
    from qualify.ppo.coverage import step_coverage

    device = reference_device(ctx.reference)
    model = _control_model(ctx, role, precision, control, master, model_dir, device)
    batch_host, targets_host = batch, targets
    batch = {k: v.to(device) for k, v in batch.items()}
    targets = {k: v.to(device) for k, v in targets.items()}
    if ctx.reference.gradient_checkpointing:
        enable_checkpointing(model)
    layers = _step_one_layers(ctx, role, control, model, batch)
    o, p = ctx.objective.optimizer, ctx.objective.ppo
    names = [n for n, _ in master.named_parameters()]
    params = list(master.parameters())
    opt = _optimizer(control, params, o)
    steps, coverage, grad_dtypes, master_grad_dtypes = [], [], {}, {}
    for k, rows in enumerate(step_rows(batch["input_ids_BT"].shape[0], p.epochs, p.minibatches)):
        mb = {key: v[rows] for key, v in batch.items()}
        step_targets = rows_of(targets, rows)
        if decided is not None:
            step_targets[DECIDED_KEY] = decided[k].to(device)
        outputs = _forward_backward(ctx, role, control, model, mb, step_targets, vocab_size)
        grad_dtypes = _master_grads(master, model)
        master_grad_dtypes = {n: str(q.grad.dtype).removeprefix("torch.") for n, q in zip(names, params)
                              if q.grad is not None}
        step, grad_norm = _optimizer_step(opt, names, params, outputs, o.max_grad_norm, keep_on_device)
        steps.append(step)
        coverage.append(step_coverage(role, p, o.max_grad_norm, step["outputs"], rows_of(targets_host, rows),
                                      batch_host["response_mask_BT"][rows], float(grad_norm),
                                      int(opt.state[params[0]]["step"])))
        _next_step(opt, master, model)
    meta = {"compute_grad_dtypes": grad_dtypes,
            "grad_dtypes": master_grad_dtypes, "master_dtype": "float32",
            "state_dtypes": {n: str(opt.state[q]["exp_avg"].dtype).removeprefix("torch.") for n, q in zip(names, params)},
            "num_steps": len(steps), "coverage": coverage}
    return {"steps": steps, "meta": meta} | ({} if layers is None else {"layers": layers})


def _control_model(ctx: ScoringContext, role: str, precision: str, control: Control, master: torch.nn.Module,
                   model_dir: Path, device: torch.device) -> torch.nn.Module:
    """The module the control's forward and backward run in, on device, its linears and norms computed as the
    control computes them (the master moved to device too unless it is offloaded to the host)."""
    offload = ctx.reference.offload == "host"
    if not offload:
        master.to(device)
    model = _compute_model(master, precision, model_dir, role, control.attn_impl, device, offload)
    split_like_tp(model, control.tp)
    if control.fused:  # after the TP split (combined): the fused groups are then one whole GEMM each
        fuse_projections(model)
    if control.fused_norm:
        fuse_norms(model)
    return model


def _step_one_layers(ctx: ScoringContext, role: str, control: Control, model: torch.nn.Module,
                     batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Per-layer activations of step 1's forward, split and ordered as this control runs it (qualify diagnose), on the
    host; None unless reference.layer_activations."""
    rows0 = step_rows(batch["input_ids_BT"].shape[0], ctx.objective.ppo.epochs, ctx.objective.ppo.minibatches)[0]
    routes0 = replayed_routes(ctx.rollout, role, batch)
    return {k: v.cpu() for k, v in capture_layer_outputs(
        model, batch["input_ids_BT"][rows0], control.microbatches, control.reverse_rows,
        None if routes0 is None else routes0[rows0]).items()} if ctx.reference.layer_activations else None


def _optimizer(control: Control, params: list[torch.nn.Parameter], o: Any) -> torch.optim.Optimizer:
    """The AdamW the control steps (Control.adam_form) over the master's parameters."""
    if control.adam_form != "torch":
        from qualify.reference.adam_order import ADAM_FORMS

        return ADAM_FORMS[control.adam_form](params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=False)


def _optimizer_step(opt: torch.optim.Optimizer, names: list[str], params: list[torch.nn.Parameter],
                    outputs: dict[str, torch.Tensor], max_grad_norm: float,
                    keep_on_device: bool) -> tuple[dict[str, Any], torch.Tensor]:
    """Clip and step the master's gradients: (the step's record of outputs, gradients, updates and moments; the
    gradient norm)."""
    kept = _kept if keep_on_device else _host
    grads = {n: (kept(q.grad) if q.grad is not None else torch.zeros(q.shape, dtype=q.dtype,
                                                                  device=q.device if keep_on_device else "cpu"))
             for n, q in zip(names, params)}
    before = {n: q.detach().clone() for n, q in zip(names, params)}
    max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
    grad_norm = clip_grad_norm(params, max_norm)
    opt.step()
    outputs["grad_norm"] = grad_norm.detach().to(torch.float32)
    outputs = {k: _host(v) for k, v in outputs.items()}
    state = {n: opt.state[q] for n, q in zip(names, params)}
    step = {"outputs": outputs, "grads": grads,
            "updates": {n: kept(q.detach() - before[n]) for n, q in zip(names, params)},
            "moments": {f"{key}/{n}": kept(st[key]) for n, st in state.items() for key in ("exp_avg", "exp_avg_sq")}}
    return step, grad_norm


def _next_step(opt: torch.optim.Optimizer, master: torch.nn.Module, model: torch.nn.Module) -> None:
    """Gradients cleared and the compute copy refreshed from the stepped FP32 master."""
    opt.zero_grad(set_to_none=True)
    if model is not master:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for mp, cp in zip(master.parameters(), model.parameters()):
                cp.copy_(mp)


def _forward_backward(ctx: ScoringContext, role: str, control: Control, model: torch.nn.Module,
                      batch: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
                      vocab_size: int) -> dict[str, torch.Tensor]:
    """Forward, objective and backward of one optimizer step's rows (split into the control's micro-batches)."""
    order = torch.arange(batch["input_ids_BT"].shape[0], device=batch["input_ids_BT"].device)
    if control.reverse_rows:
        order = order.flip(0)
    ids_BT, mask_BT, routes_BTLK, tgt = _in_order(ctx, role, batch, targets, order)
    p, grpo = ctx.objective.ppo, ctx.objective.grpo
    parts: dict[str, list[torch.Tensor]] = {}
    totals = {key: torch.zeros((), dtype=torch.float32, device=mask_BT.device)
              for key in ("loss", "clip_frac") + (("kl_mean", "policy_loss") if grpo else ())}
    # the whole step's normalizers (GRPO: and advantages, rows in their own order): each micro-batch takes its share
    mask_step_BT = batch["response_mask_BT"]
    share = grpo_share(grpo, targets["score_B"], mask_step_BT) if grpo else ppo_share(mask_step_BT)
    lengths_B, slices = _microbatches(control, batch, order)
    for rows in slices:
        part = share if grpo is None else GRPOShare(share.advantages_B[order][rows], share.normalizers)
        m_BT = mask_BT[rows]
        packed = None if lengths_B is None else pack_rows(ids_BT, mask_BT, lengths_B, rows)
        # a MoE actor replays the rollout's routes through the forward and the backward (which may recompute it)
        recorded: list = []
        with routing(model, None if routes_BTLK is None else routes_BTLK[rows], outputs=recorded):
            if role == "actor":
                scores_BT, processed_BT, entropy_BT = _actor_scores(ctx, model, ids_BT[rows], vocab_size, packed,
                                                                    entropy=p.entropy_coef > 0)
                for key, t in router_outputs(recorded, *ids_BT[rows].shape).items():  # a MoE actor's routers
                    parts.setdefault(key, []).append(t)
                if processed_BT is not None:  # the processed formula a candidate may declare; bitwise full untruncated
                    parts.setdefault(PROCESSED_KEY, []).append(torch.where(m_BT, processed_BT, 0.0))
            elif packed is not None:
                scores_BT, entropy_BT = _unpacked(critic_values(model, packed.input_ids_1N, packed.position_ids_1N),
                                                  packed, ids_BT.shape[1]), None
            else:
                scores_BT, entropy_BT = critic_values(model, ids_BT[rows]), None
            loss, out = role_objective(role, p, scores_BT, m_BT, rows_of(tgt, rows), grpo=grpo, share=part,
                                       entropy_BT=entropy_BT)
            for key in ("logprobs_BT", "ratio_BT", "values_BT", "kl_BT", "advantages_B", "seq_loss_B", "entropy_BT"):
                if key in out:
                    parts.setdefault(key, []).append(out[key])
            loss.backward()
        totals["loss"] += loss.detach()
        for key in totals.keys() - {"loss"}:
            totals[key] += out[key].detach()
    undo = torch.argsort(order)
    outputs = {k: torch.cat(v)[undo] for k, v in parts.items()}
    outputs.update(totals)
    if role == "actor" and grpo is None:  # PPO's KL is judged as a masked mean (GRPO's is its aggregated term)
        kl_BT = kl_terms(outputs["logprobs_BT"], targets["ref_logprobs_BT"]) * batch["response_mask_BT"]
        outputs["kl_BT"] = kl_BT
        outputs["kl_mean"] = masked_mean(kl_BT, batch["response_mask_BT"], "global")
    return outputs


def _in_order(ctx: ScoringContext, role: str, batch: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
              order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """The step's token ids, response mask, replayed routes (None: no MoE routes replayed) and targets in the
    control's row order."""
    routes_BTLK = replayed_routes(ctx.rollout, role, batch)
    if routes_BTLK is not None:
        routes_BTLK = routes_BTLK[order]
    return (batch["input_ids_BT"][order], batch["response_mask_BT"][order], routes_BTLK,
            {k: v[order] for k, v in targets.items()})


def _microbatches(control: Control, batch: dict[str, torch.Tensor],
                  order: torch.Tensor) -> tuple[torch.Tensor | None, list[slice]]:
    """(the samples' lengths in row order, packed controls only; the micro-batches' row slices): whole samples packed
    in the control's row order (qualify.case.packing), else the rows split in control.microbatches."""
    if control.pack_tokens is not None:
        lengths_B = sample_lengths(batch["prompt_mask_BT"], batch["response_mask_BT"])[order].cpu()
        return lengths_B, plan_packs(lengths_B.tolist(), control.pack_tokens)
    return None, _row_slices(batch["input_ids_BT"].shape[0], control.microbatches)


def _actor_scores(ctx: ScoringContext, model: torch.nn.Module, ids_BT: torch.Tensor, vocab_size: int,
                  packed: PackedBatch | None, entropy: bool) -> ActorScores:
    """qualify.models.hf.actor_scores of the rows, or of their packed micro-batch unpacked to the rows' layout."""
    sampling, chunk = rollout_sampling(ctx.rollout), ctx.reference.logprob_chunk_tokens
    if packed is None:
        return actor_scores(model, ids_BT, sampling, chunk, vocab_size, entropy=entropy)
    found = actor_scores(model, packed.input_ids_1N, sampling, chunk, vocab_size, entropy=entropy,
                         position_ids=packed.position_ids_1N)
    return ActorScores(*(None if t is None else _unpacked(t, packed, ids_BT.shape[1]) for t in found))


def _unpacked(values_1N: torch.Tensor, packed: PackedBatch, seq_len: int) -> torch.Tensor:
    """A packed forward's per-token values at the rows' (row, position), each sample's first token 0."""
    return unpack(zero_sample_starts(values_1N, packed), packed, seq_len)


def _master_grads(master: torch.nn.Module, model: torch.nn.Module) -> dict[str, str]:
    """Cast the compute copy's gradients into the FP32 master's; return the compute gradients' dtypes."""
    grad_dtypes = {}
    for (name, mp), (_, cp) in zip(master.named_parameters(), model.named_parameters()):
        grad_dtypes[name] = str(cp.grad.dtype).removeprefix("torch.") if cp.grad is not None else "none"
        if cp is not mp:
            mp.grad = None if cp.grad is None else cp.grad.detach().to(device=mp.device, dtype=torch.float32)
    return grad_dtypes
