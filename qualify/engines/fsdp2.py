"""fsdp2: Hugging Face Qwen3 under torch's fully_shard (FSDP2) over a DP mesh, with TP on a 2D mesh (gloo or NCCL).

torchtitan's composition: the ranks form a (dp, tp) mesh (dp_rank x tp + tp_rank, TP within a row); TP > 1 applies
torch-tp's plan (qualify.engines.torch_tp.tp_plan) with parallelize_module on the 'tp' dimension, then every decoder
layer and the whole model are fully_shard()ed over the 'dp' dimension. Each parameter is then one DTensor sharded
along dim 0 over DP (and as TP placed it over TP): the FP32 master. In the forward FSDP2 all-gathers each layer's
parameters in MixedPrecisionPolicy.param_dtype (bf16 for a bf16 case: the compute copy; fp32 otherwise), and after
the backward it reduce-scatters the gradients over DP in reduce_dtype (fp32) into FP32 sharded gradients. torch's
AdamW steps the sharded parameters, so its state is sharded as they are (qualify.engines.sharded_state checks it is,
and complete, before it is gathered). Evidence is read through DTensor's own gather (full_tensor()).

The loss contract: each DP rank's loss is already its share of the step's (global normalizers), so the gradients
must be summed over DP. FSDP2 averages by default (ReduceOp.AVG, or a PREMUL_SUM by 1/factor where a divide factor is
set, which gloo refuses); every FSDP module gets set_gradient_divide_factor(1.0) and
set_force_sum_reduction_for_comms(True): a plain SUM reduce-scatter with no division (torch 2.13,
_fsdp_collectives._get_gradient_divide_factors). q_norm and k_norm act on each TP rank's own heads, so their
gradients are partial sums over TP: all-reduced over the 'tp' dimension after the backward, as torch-tp does.
A parameter is used in the next forward only as FSDP2 gathers it again from the stepped shards (the default
reshard after forward and after backward); no unsharded copy outlives a step.
Packed micro-batches are scored as torch-tp scores them; the backward of every one but the step's last runs with
set_requires_gradient_sync(False), so FSDP2 accumulates the unsharded gradients (in reduce_dtype) and reduce-scatters
their sum once, after the last.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from qualify.engines.base import EngineContext
from qualify.engines.sharded_state import check_sharded_state
from qualify.engines.torch_tp import TorchTPEngine, full, local, tp_plan
from qualify.errors import EngineError
from qualify.models.hf import dtype_name, load_model, model_type
from qualify.models.precision import torch_dtype


def dtensor_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm (fp32) of sharded gradients, each tensor's reduced through DTensor (its local shard's norm,
    then the norm's reduction over the mesh): on the CPU each shard's norm in float64 (qualify.engines.torch_tp.grad_norm
    says why), on a GPU in the gradient's own fp32."""
    from torch.distributed.tensor import DTensor

    norms = []
    for g in grads:
        n = torch.linalg.vector_norm(g, dtype=torch.float64 if g.device.type == "cpu" else None)
        norms.append((n.full_tensor() if isinstance(n, DTensor) else n).double().cpu())
    return torch.linalg.vector_norm(torch.stack(norms)).to(torch.float32)


class FSDP2Engine(TorchTPEngine):
    """The fsdp2 engine (see module docstring). Its forward and scoring are torch-tp's, on the FSDP2 module."""

    name = "fsdp2"
    reduce_dtype = torch.float32
    """MixedPrecisionPolicy.reduce_dtype: the dtype the gradients are reduce-scattered in."""

    def setup(self, ctx: EngineContext) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        self.ctx = ctx
        device_type = "cuda" if ctx.device.startswith("cuda") else "cpu"
        mesh = init_device_mesh(device_type, (ctx.dp, ctx.tp), mesh_dim_names=("dp", "tp"))
        self.mesh, self.dp_mesh, self.dp_group = mesh["tp"], mesh["dp"], None
        model = load_model(ctx.model_dir, ctx.role, "sdpa").to(ctx.device)
        tied = ctx.role == "actor" and bool(model.config.tie_word_embeddings)
        if tied and ctx.vocab_tile is not None and ctx.tp > 1:
            raise EngineError("fsdp2 keeps a tied LM head whole over TP (the input embedding is not TP-sharded), so "
                              "it has no vocabulary shard to score by vocab_tile: leave vocab_tile unset for a model "
                              "with tie_word_embeddings")
        self.vocab_parallel = ctx.vocab_tile is not None and ctx.role == "actor"
        if ctx.tp > 1:
            parallelize_module(model, self.mesh, tp_plan(ctx.role, self.vocab_parallel,
                                                         moe=model_type(ctx.model_dir) == "qwen3_moe", tied=tied))
        policy = MixedPrecisionPolicy(param_dtype=torch_dtype(ctx.precision) if ctx.precision != "fp32" else None,
                                      reduce_dtype=self.reduce_dtype)
        for layer in model.model.layers:
            fully_shard(layer, mesh=self.dp_mesh, mp_policy=policy)
        fully_shard(model, mesh=self.dp_mesh, mp_policy=policy)
        for module in model.modules():
            if isinstance(module, FSDPModule):  # per FSDP module: neither setting reaches the modules below it
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self.master = self.compute = model
        # the sharded parameters, kept by name: while FSDP2 holds a module unsharded its registered parameters are the
        # unsharded (compute) tensors, not these
        self.sharded: dict[str, torch.Tensor] = dict(model.named_parameters())
        not_fp32 = [n for n, p in self.sharded.items() if p.dtype != torch.float32]
        if not_fp32:
            raise EngineError(f"fsdp2: the sharded parameters must be the FP32 masters; {', '.join(not_fp32[:3])} "
                              f"are {dtype_name(self.sharded[not_fp32[0]])}")
        o = ctx.optimizer
        self.optimizer = torch.optim.AdamW(self.sharded.values(), lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay, foreach=False)

    def backward(self, loss: torch.Tensor) -> None:
        # a packed micro-batch before the step's last: FSDP2 only accumulates the unsharded gradients (in reduce_dtype)
        self.master.set_requires_gradient_sync(not self.accumulating)
        loss.backward()  # FSDP2 reduce-scatters every gradient over DP (a sum in reduce_dtype) into the sharded .grad
        if self.accumulating:
            return
        if self.ctx.tp > 1:
            for name, p in self.sharded.items():
                if name.endswith(self.grad_allreduce_suffixes):
                    dist.all_reduce(local(p.grad), op=dist.ReduceOp.SUM, group=self.mesh.get_group())

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The pre-clip global norm of the sharded gradients, reduced over every rank's shard through DTensor."""
        return dtensor_grad_norm(grads)

    def step(self) -> torch.Tensor:
        params = [p for p in self.sharded.values() if p.grad is not None]
        total = self.grad_norm([p.grad for p in params])
        max_norm = self.ctx.optimizer.max_grad_norm
        if max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for p in params:
                local(p.grad).mul_(coef.to(local(p.grad).device))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: full(p.grad) for n, p in self.sharded.items()}

    def grad_dtypes(self) -> dict[str, str]:
        """The sharded gradients' dtype: what AdamW reads (FP32 under bf16: reduce_dtype, cast to the masters')."""
        return {n: dtype_name(p.grad) for n, p in self.sharded.items()}

    def params(self) -> dict[str, torch.Tensor]:
        return {n: full(p) for n, p in self.sharded.items()}

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        named = self.sharded
        problems = check_sharded_state(named, self.optimizer.state)
        if problems:
            raise EngineError(f"fsdp2: the optimizer state is not sharded as its parameters: {'; '.join(problems[:3])}"
                              f"{f' (and {len(problems) - 3} more)' if len(problems) > 3 else ''}")
        out: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
        for name, p in named.items():
            if p in self.optimizer.state:
                for key, by_name in out.items():
                    by_name[name] = self.optimizer.state[p][key].full_tensor().detach().cpu().clone()
        return out

    def replicated(self) -> dict[str, torch.Tensor]:
        """The parameters TP does not shard (norms, embeddings, the critic's head), each gathered over DP: every rank
        of the launch must hold the same tensor."""
        from torch.distributed.tensor import Shard

        out = {}
        for name, p in self.sharded.items():
            tp_dim = p.device_mesh.mesh_dim_names.index("tp") if "tp" in (p.device_mesh.mesh_dim_names or ()) else None
            if tp_dim is None or not isinstance(p.placements[tp_dim], Shard):
                out[name] = p.full_tensor().detach().cpu()
        return out

    def close(self) -> None:
        self.optimizer = None
