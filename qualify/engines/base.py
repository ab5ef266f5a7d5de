"""The engine Protocol every candidate adapter implements, and what it is given.

A case runs in every rank of its launch (qualify.case.launch: tp x dp ranks started with torchrun's rank variables,
as fresh interpreters or, on the CPU, forked from a warm server; srun's variables serve too). The shared case runner
(qualify.candidate.worker) asks the engine for scores (the actor's sampler-formula
logprobs or the critic's values), builds the loss with qualify.ppo (or the engine's
own objective hook), calls backward and step K times, and exports what the engine
holds after each step. Every exported tensor is a full (unsharded) FP32 tensor under its Hugging
Face name, so the verdict compares name for name with the reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from qualify.case.context import Batch, EngineContext, PackedBatch

if TYPE_CHECKING:
    import torch

__all__ = ["Batch", "EngineContext", "OutputScoring", "PackedBatch", "TrainEngine"]
"""Batch, PackedBatch and EngineContext live with the case (qualify.case.context); an engine plugin may import them
from here."""


class OutputScoring:
    """score() from full (unsharded) model outputs, shared by the built-in adapters: it keeps the last outputs'
    logprobs in the declared formula and the actor's logits for the logprobs() and logits() hooks."""

    ctx: EngineContext
    last_logits: torch.Tensor | None = None
    last_routes: torch.Tensor | None = None
    """The experts a MoE model's routers returned in the last score() (routed()); None for a dense model."""
    last_router: dict[str, torch.Tensor] | None = None
    """The last score()'s router logits and routing weights (routed(); qualify.models.routing.ROUTER_OUTPUTS)."""
    declared_BT: torch.Tensor | None = None
    """The last score()'s logprobs in the declared formula (None until score() runs, or for a subclass whose own
    score() does not set it: the worker then judges score()'s values)."""
    graph_logits: torch.Tensor | None = None
    """The actor's last score() logits inside the loss graph (not detached: entropy() differentiates through them);
    None for the critic or a path that holds no full logits."""
    last_entropy: torch.Tensor | None = None
    """entropy()'s answer for the last score(), made on the first call (so every caller sees the same tensor)."""

    def scores_from(self, out_BTX: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
        """(B, T) fp32 scores on CPU (qualify.models.hf.scores_from_outputs) of full outputs (B, T, V or 1) of
        ids_BT, keeping what the hooks report."""
        from qualify.models.hf import declared_logprobs, scores_from_outputs

        self.declared_BT = declared_logprobs(self.ctx, out_BTX.detach(), ids_BT)
        self.last_logits = out_BTX.detach() if self.ctx.role == "actor" else None
        self.graph_logits = out_BTX if self.ctx.role == "actor" else None
        self.last_entropy = None
        return scores_from_outputs(self.ctx.role, out_BTX, ids_BT, self.ctx.temperature,
                                   self.ctx.logprob_chunk_tokens, self.ctx.vocab_size).cpu()

    def packed_scores_from(self, out_1NX: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """(1, N) fp32 scores on CPU of full outputs (1, N, V or 1) of a packed micro-batch: scores_from over the
        pack, each sample's first token set to 0 (scored from the previous sample's last token, it has no context in
        its own); the hooks' logprobs likewise, the logits as computed (1, N, V)."""
        from qualify.case.packing import zero_sample_starts

        scores_1N = zero_sample_starts(self.scores_from(out_1NX, batch.input_ids_1N), batch)
        if self.declared_BT is not None:
            self.declared_BT = zero_sample_starts(self.declared_BT, batch)
        return scores_1N

    @contextmanager
    def routed(self, model: torch.nn.Module, batch: Batch) -> Iterator[None]:
        """Record, for the routes() hook, the experts every MoE router of an HF model returns during the block (one
        forward of batch)."""
        from qualify.models.routing import moe_routers, own_routes_BTLK, router_outputs, routing

        own: list = []
        recorded: list = []
        with routing(model, None, own, recorded):
            yield
        moe = bool(moe_routers(model))
        self.last_routes = own_routes_BTLK(own, *batch.input_ids_BT.shape) if moe else None
        self.last_router = router_outputs(recorded, *batch.input_ids_BT.shape) if moe else None

    def routes(self) -> torch.Tensor | None:
        """(B, T, MoE layers, top_k) experts the last score() routed each token to; None for a dense model."""
        return self.last_routes

    def router_outputs(self) -> dict[str, torch.Tensor] | None:
        """The last score()'s router logits and routing weights, full fp32 (B, T, MoE layers, E or top_k) under
        qualify.models.routing.ROUTER_OUTPUTS' names; None for a dense model."""
        return self.last_router

    def logprobs(self) -> torch.Tensor | None:
        """The last score()'s logprobs in the declared formula (None: score()'s own, the full formula)."""
        return self.declared_BT

    def entropy(self) -> torch.Tensor | None:
        """(B, T) fp32 entropy (on CPU, differentiable: the same forward's graph, qualify.models.hf.entropy_from_outputs)
        of the sampler distribution at each position of the last score(); None for the critic or without full
        logits (the vocab-parallel path)."""
        if self.last_entropy is None and self.graph_logits is not None:
            from qualify.models.hf import entropy_from_outputs

            c = self.ctx
            self.last_entropy = entropy_from_outputs(self.graph_logits, c.temperature, c.logprob_chunk_tokens,
                                                     c.vocab_size).cpu()
        return self.last_entropy

    def logits(self) -> torch.Tensor | None:
        """The last score()'s full-vocabulary logits, as computed (qualify.judge.derived: the logprobs are derived
        from them); None for the critic."""
        return self.last_logits


class TrainEngine(Protocol):
    """A training engine qualified by qualify (built in or a user's plugin)."""

    name: str

    def setup(self, ctx: EngineContext) -> None:
        """Load the HF checkpoint with TP sharding in ctx.precision and build the optimizer."""

    def score(self, batch: Batch) -> torch.Tensor:
        """(B, T) fp32, differentiable: actor logprobs by the sampler formula, or critic values. An engine that
        declares packed = True also takes a PackedBatch and returns (1, N) (qualify.case.context.PackedBatch)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate loss into the engine's FP32 gradient buffers (reduced across TP where needed). In a packed
        case it is called once per micro-batch, after that micro-batch's score(): the engine accumulates, and reduces
        after the backward of the micro-batch marked last (PackedBatch.last)."""

    def grads(self) -> dict[str, torch.Tensor]:
        """Full FP32 gradients in HF names, as held before clipping."""

    def grad_dtypes(self) -> dict[str, str]:
        """dtype of the gradient buffer the optimizer reads, per HF name."""

    def step(self) -> torch.Tensor:
        """Clip to optimizer.max_grad_norm and take one AdamW step; return the pre-clip global norm (fp32).

        A case takes several steps: afterwards the gradients are cleared and any compute copy holds the
        stepped master weights, so that the next score() and backward() start from them."""

    def params(self) -> dict[str, torch.Tensor]:
        """Full FP32 master parameters in HF names."""

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{'exp_avg': {name: tensor}, 'exp_avg_sq': {...}} full tensors in HF names, in their own dtype."""

    def replicated(self) -> dict[str, torch.Tensor]:
        """This rank's local copies of parameters replicated across TP (norms), for replica checks."""

    def padded_rows(self) -> dict[str, torch.Tensor]:
        """Rows of vocab-sized parameters beyond vocab_size on this rank (empty when unpadded)."""

    def close(self) -> None:
        """Release process groups and engine resources."""

    # Optional: an engine that takes packed batches (candidates.packing: packed) says so with a class attribute
    #   packed = True
    # its score() then also takes a PackedBatch (one micro-batch of whole samples, padding removed, position ids
    # restarting per sample, cu_seqlens) and returns (1, N) per-token scores, and its backward() accumulates over
    # the step's micro-batches (docs/plugins.md, "Packed batches"). Its logprobs() and logits() hooks report the
    # last micro-batch's (1, N) and (1, N, V), which the harness unpacks like the scores. Without it a packed case
    # of the engine is refused.
    # Optional: an engine whose reported logprobs are not score()'s own values implements
    #   logprobs() -> Tensor | None
    # the (B, T) fp32 logprobs of the last score()'s tokens in ctx.logprob_formula (qualify.models.hf.declared_logprobs
    # makes them from full outputs), None where score()'s values are them; the harness judges them as
    # outputs/logprobs_BT. Without the hook score()'s values are judged: the full formula.
    # Optional (an actor without it fails its logprob derivation unless the matrix waives sampler_derivation for it:
    # candidates.waive):
    #   logits() -> Tensor | None
    # the last score()'s full-vocabulary logits of this rank's rows, as computed, before the temperature (None for the
    # critic); the harness derives the reported logprobs from them (qualify.judge.derived). OutputScoring has it.
    # Optional: an engine that brings its own loss code implements
    #   objective(role, ppo, scores_BT, response_mask_BT, targets, *, share) -> (loss, outputs)
    # returning the outputs qualify.ppo.objective.role_objective returns (actor: logprobs_BT, ratio_BT, kl_BT,
    # kl_mean, clip_frac; critic: values_BT, clip_frac); the harness then judges those instead of its own. share
    # (qualify.ppo.objective.PPOShare; GRPO: GRPOShare, with grpo= too) holds the step's normalizers over every DP
    # rank: the loss and scalars are this rank's share. Without share= it runs under PPO at DP1 only.
    # Optional (required with ppo.entropy_coef > 0): an actor engine implements
    #   entropy() -> Tensor | None
    # the (B, T) fp32 entropy of softmax(logits / temperature) over the real vocabulary at each position of its last
    # score() (position t: the distribution token t was scored under, as the logprobs), differentiable through the
    # same forward's graph, so that the entropy bonus trains the model (a detached copy would train nothing).
    # OutputScoring implements it from the logits score() kept; an engine without it (or answering None) is refused.
    # Optional: a MoE engine implements
    #   routes() -> Tensor | None
    # the (B, T, MoE layers, top_k) expert ids its last score() routed each token to (OutputScoring.routed records them
    # from an HF model's routers); with rollout.routing replay the harness holds them to the batch's routes_BTLK on
    # every token the rollout fed (qualify.judge.derived.replay_rows). Without it the replay is not verified.
    #   router_outputs() -> dict | None
    # the last score()'s router logits and routing weights (qualify.models.routing.ROUTER_OUTPUTS), judged against the
    # reference's as outputs/<name>; a MoE engine without it fails those rows as missing.
    # Optional: an engine that exposes its per-layer activations implements
    #   layer_outputs(batch) -> dict[str, Tensor]
    # full (unsharded) fp32 (B, T, H) outputs of one no-grad forward, named after the HF modules
    # (qualify.models.hooks.activation_names: each layer's input_layernorm, self_attn, post_attention_layernorm,
    # mlp, the layer itself, then model.norm); `qualify diagnose` compares them with the reference's layer by layer.
    #   exact_layer_outputs(batch) -> dict[str, Tensor]
    # only 'model.layers.<i>' and 'model.norm', from the forward score() runs where that is not layer_outputs' forward
    # (qualify.examples.vllm_gpu_exact); the exact tier prefers it (qualify.judge.layer_probe).
