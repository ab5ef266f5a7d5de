"""torch-tp: Hugging Face Qwen3 parallelized with torch.distributed.tensor.parallel (gloo or NCCL).

q/k/v and gate/up are column-parallel, o and down row-parallel, the LM head column-parallel with
replicated output (full logits on every rank). q_norm and k_norm act on each rank's own heads,
so their gradients are partial sums: they are all-reduced across TP before clipping (the trap
transformers' own tp plan calls replicated_with_grad_allreduce). BF16 runs a bf16 copy of the
sharded model and keeps FP32 master parameters, FP32 gradients and FP32 AdamW state.
With DP (ctx.dp > 1) the ranks form a (dp, tp) mesh and gradients are summed over the DP ranks after backward.
A Qwen3-MoE model keeps its routers and experts replicated (every rank routes every token and runs every expert on
the replicated hidden states; only attention and the LM head are sharded), and replays a batch's routes by its own
router forward (routes_replayed).
A packed micro-batch (qualify.case.context.PackedBatch) is scored through transformers' packed position_ids path:
with no attention mask, its masking_utils finds each sample where the position ids restart and attends block-
diagonally, causal within each sample (sdpa and eager; flash-attention reads the same boundaries as cu_seqlens).
Gradients accumulate over a step's micro-batches and are reduced after the last one's backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from qualify.engines.base import Batch, EngineContext, OutputScoring, PackedBatch
from qualify.errors import EngineError
from qualify.models.hf import dtype_name, load_model, model_type
from qualify.models.precision import torch_dtype

GRAD_ALLREDUCE_SUFFIXES = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def tp_plan(role: str, vocab_parallel: bool = False, moe: bool = False, tied: bool = False) -> dict:
    """The TP plan; vocab_parallel: the LM head's output stays sharded over the vocabulary (each rank its columns);
    moe: the MLPs are routers and experts, kept whole on every rank; tied: the LM head is the input embedding
    (tie_word_embeddings, as Qwen3-0.6B): it stays whole on every rank, tied. Sharding it would give the head its own
    parameter (parallelize_module swaps in a DTensor), untying it: an extra 'lm_head.weight' trained apart, and an
    embedding gradient without the head's part (at Qwen3-0.6B far off the reference's: benchmarks/LOG.md)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    mlp = () if moe else ("mlp.gate_proj", "mlp.up_proj")
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", *mlp):
        plan[f"model.layers.*.{proj}"] = ColwiseParallel()
    for proj in ("self_attn.o_proj", *(() if moe else ("mlp.down_proj",))):
        plan[f"model.layers.*.{proj}"] = RowwiseParallel()
    if role == "actor" and not tied:
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1) if vocab_parallel else Replicate())
    return plan


@contextmanager
def routes_replayed(model: torch.nn.Module, routes_BTLK: torch.Tensor | None) -> Iterator[None]:
    """torch-tp's routing replay: while the block runs, each MoE layer's router (mlp.gate) takes its experts from
    routes_BTLK (B, T, MoE layers, top_k; -1: its own top-k) and its weights from its live softmax over every expert,
    renormalized over the chosen ones as the router does. Nothing changes when routes_BTLK is None."""
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    if routes_BTLK is None or not gates:
        yield
        return
    if routes_BTLK.shape[2] != len(gates):
        raise EngineError(f"the batch holds routes of {routes_BTLK.shape[2]} MoE layers, the model has {len(gates)}")
    device = gates[0].weight.device
    for layer, gate in enumerate(gates):
        given = routes_BTLK[:, :, layer].reshape(-1, routes_BTLK.shape[-1]).to(device=device, dtype=torch.long)

        def forward(hidden, gate=gate, given=given):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            experts = torch.where(given < 0, torch.topk(probs, gate.top_k, dim=-1).indices, given)
            weights = probs.gather(1, experts)
            if gate.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), experts

        gate.forward = forward
    try:
        yield
    finally:
        for gate in gates:
            del gate.forward  # the class's forward again


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def gathered_columns(shard_BTW: torch.Tensor, group) -> torch.Tensor:
    """The whole (B, T, V) of every rank's (B, T, W_r) vocabulary columns, in rank order (widths may differ)."""
    widths = [torch.zeros(1, dtype=torch.int64, device=shard_BTW.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(widths, torch.tensor([shard_BTW.shape[-1]], device=shard_BTW.device), group=group)
    most = int(max(w.item() for w in widths))
    padded = torch.nn.functional.pad(shard_BTW.detach(), (0, most - shard_BTW.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in widths]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[..., :int(w.item())] for p, w in zip(parts, widths)], dim=-1)


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm (fp32) of full gradients, each reduced where it lives: a GPU's fp32 vector_norm reduces in a
    tree; the CPU's adds serially in fp32 (9e-5 off for a gradient shaped like Qwen3's embedding, 2% for 155M dense
    elements: pytorch#169237, BENCHMARKS), so there each tensor's norm is accumulated in float64. The clip
    coefficient is then that of the norm the gradients have, which qualify.judge.derived holds every engine to."""
    norms = [torch.linalg.vector_norm(g, dtype=torch.float64 if g.device.type == "cpu" else None).double().cpu()
             for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms)).to(torch.float32)


def device_full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on its own device (a TP-sharded DTensor gathered), detached."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    # clone: for a plain fp32 CPU tensor .float().cpu() is the tensor itself, and clipping is in place
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


class TorchTPEngine(OutputScoring):
    """The torch-tp engine (see module docstring)."""

    name = "torch-tp"
    grad_allreduce_suffixes = GRAD_ALLREDUCE_SUFFIXES
    packed = True
    """Takes packed batches (see the module docstring)."""
    accumulating = False
    """The last score() was of a packed micro-batch before the step's last: its backward() only accumulates."""

    def setup(self, ctx: EngineContext) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        self.ctx = ctx
        device_type = "cuda" if ctx.device.startswith("cuda") else "cpu"
        if ctx.dp > 1:  # ranks dp_rank x tp + tp_rank: TP within a row of the mesh, DP across its rows
            mesh = init_device_mesh(device_type, (ctx.dp, ctx.tp), mesh_dim_names=("dp", "tp"))
            self.mesh, self.dp_group = mesh["tp"], mesh["dp"].get_group()
        else:
            self.mesh, self.dp_group = init_device_mesh(device_type, (ctx.tp,)), None
        self.master = load_model(ctx.model_dir, ctx.role, "sdpa").to(ctx.device)
        tied = ctx.role == "actor" and bool(self.master.config.tie_word_embeddings)
        if tied and ctx.vocab_tile is not None and ctx.tp > 1:
            raise EngineError("torch-tp keeps a tied LM head whole on every rank (the input embedding is not "
                              "sharded), so it has no vocabulary shard to score by vocab_tile: leave vocab_tile "
                              "unset for a model with tie_word_embeddings")
        self.vocab_parallel = ctx.vocab_tile is not None and ctx.role == "actor"
        plan = tp_plan(ctx.role, self.vocab_parallel, moe=model_type(ctx.model_dir) == "qwen3_moe", tied=tied)
        parallelize_module(self.master, self.mesh, plan)
        self.compute = self.master
        if ctx.precision != "fp32":
            self.compute = load_model(ctx.model_dir, ctx.role, "sdpa", torch_dtype(ctx.precision)).to(ctx.device)
            parallelize_module(self.compute, self.mesh, plan)
            with torch.no_grad():
                for mp, cp in zip(self.master.parameters(), self.compute.parameters()):
                    local(cp).copy_(local(mp))
        o = ctx.optimizer
        self.optimizer = torch.optim.AdamW(self.master.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay, foreach=False)

    def score(self, batch: Batch | PackedBatch) -> torch.Tensor:
        if isinstance(batch, PackedBatch):
            return self.packed_score(batch)
        self.accumulating = False
        ids_BT = batch.input_ids_BT.to(self.ctx.device)
        with self.routed(self.compute, batch), routes_replayed(self.compute, batch.routes_BTLK):
            if self.vocab_parallel:
                return self.vocab_parallel_scores(ids_BT)
            return self.scores_from(local(self.compute(input_ids=ids_BT, use_cache=False).logits), ids_BT)

    def packed_score(self, batch: PackedBatch) -> torch.Tensor:
        """(1, N) scores of a packed micro-batch: position ids restarting per sample, no attention mask (see the
        module docstring); each sample's first token 0."""
        from qualify.case.packing import zero_sample_starts

        self.accumulating = not batch.last
        ids_1N, pos_1N = batch.input_ids_1N.to(self.ctx.device), batch.position_ids_1N.to(self.ctx.device)
        if self.vocab_parallel:
            return zero_sample_starts(self.vocab_parallel_scores(ids_1N, pos_1N), batch)
        return self.packed_scores_from(local(self.compute(input_ids=ids_1N, position_ids=pos_1N, use_cache=False)
                                             .logits), batch)

    def vocab_parallel_scores(self, ids_BT: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) logprobs by the deterministic vocab-parallel path (qualify.ppo.vocab_parallel) from this rank's
        vocabulary columns of the logits; position 0 is 0. TP1 takes the single-process form (no collective)."""
        from qualify.ppo.vocab_parallel import tp_rank_logprobs, vocab_parallel_logprobs

        out = self.compute(input_ids=ids_BT, position_ids=position_ids, use_cache=False).logits
        shard_BTW, c = local(out), self.ctx
        if c.role == "actor":  # the logits() hook's whole rows, for the derivation rows only (the path never needs them)
            self.last_logits = (shard_BTW if c.tp == 1 else gathered_columns(shard_BTW, self.mesh.get_group())).detach()
        kw = {"vocab_size": c.vocab_size, "temperature": c.temperature, "tile_size": c.vocab_tile,
              "chunk_tokens": c.logprob_chunk_tokens}
        if c.tp == 1:
            logp_BT1 = vocab_parallel_logprobs([shard_BTW[:, :-1]], ids_BT[:, 1:], **kw)
        else:
            logp_BT1 = tp_rank_logprobs(shard_BTW[:, :-1], ids_BT[:, 1:], vocab_start=c.tp_rank * shard_BTW.shape[-1],
                                        group=self.mesh.get_group(), **kw)
        self.declared_BT = None  # the full formula (the matrix refuses vocab_tile with another)
        return torch.nn.functional.pad(logp_BT1, (1, 0)).cpu()

    def layer_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Full fp32 outputs of every decoder layer's modules and the final norm (qualify diagnose)."""
        from qualify.models.hooks import capture_layer_outputs

        with routes_replayed(self.compute, batch.routes_BTLK):
            return capture_layer_outputs(self.compute, batch.input_ids_BT)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.accumulating:  # a packed micro-batch before the step's last: its gradients add up where they are
            return
        for (name, mp), cp in zip(self.master.named_parameters(), self.compute.parameters()):
            if self.ctx.tp > 1 and name.endswith(self.grad_allreduce_suffixes):
                tp_group = None if self.dp_group is None else self.mesh.get_group()
                dist.all_reduce(local(cp.grad), op=dist.ReduceOp.SUM, group=tp_group)
            if cp is not mp:
                mp.grad = cp.grad.to(torch.float32)
            if self.dp_group is not None:  # each DP rank's loss is its share of the step's: FP32 gradients sum
                dist.all_reduce(local(mp.grad), op=dist.ReduceOp.SUM, group=self.dp_group)
        if self.compute is not self.master:
            self.compute.zero_grad(set_to_none=True)

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: full(p.grad) for n, p in self.master.named_parameters()}

    def grad_dtypes(self) -> dict[str, str]:
        return {n: dtype_name(p.grad) for n, p in self.master.named_parameters()}

    def step(self) -> torch.Tensor:
        params = [p for p in self.master.parameters() if p.grad is not None]
        total = grad_norm([device_full(p.grad) for p in params])
        max_norm = self.ctx.optimizer.max_grad_norm
        if max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for p in params:
                p.grad.mul_(coef.to(local(p.grad).device))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.compute is not self.master:  # the next step's forward runs on the stepped master, rounded
            with torch.no_grad():
                for mp, cp in zip(self.master.parameters(), self.compute.parameters()):
                    local(cp).copy_(local(mp))
        return total

    def params(self) -> dict[str, torch.Tensor]:
        return {n: full(p) for n, p in self.master.named_parameters()}

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        names = {id(p): n for n, p in self.master.named_parameters()}
        out: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
        for p, state in self.optimizer.state.items():
            for key, by_name in out.items():
                t = state[key]
                by_name[names[id(p)]] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
        return out

    def replicated(self) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor, Replicate

        return {n: local(p).detach().cpu() for n, p in self.master.named_parameters()
                if not isinstance(p, DTensor) or all(isinstance(pl, Replicate) for pl in p.placements)}

    def padded_rows(self) -> dict[str, torch.Tensor]:
        return {}  # vocab-sized weights are split evenly or kept whole: no padding rows exist

    def close(self) -> None:
        self.optimizer = None
