"""What an engine is given: the fixed rollout as model inputs (Batch; a packed case's micro-batches as PackedBatch) and,
per case and rank, what it builds its model with (EngineContext, made from a case's spec by
qualify.case.spec.engine_context alone)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from qualify.matrix import Optimizer
    from qualify.ppo.formula import Sampling


@dataclass(frozen=True, slots=True)
class Batch:
    """The fixed rollout as model inputs. Sequences are right-padded; positions are 0..T-1.

    logp_BT[b, t] is log p(input_ids[b, t] | input_ids[b, :t]), defined where response_mask_BT;
    values_BT[b, t] is the critic's value of the state in which token t is emitted.
    """

    input_ids_BT: torch.Tensor  # (B, T) int64, prompt then response then padding
    response_mask_BT: torch.Tensor  # (B, T) bool, True on sampled response tokens
    routes_BTLK: torch.Tensor | None = None
    """A MoE actor's routes to replay (ctx.routing 'replay'): (B, T, MoE layers, top_k) int32, the experts the
    rollout engine routed the token at each position to, in its order of weight; -1 where it fed no token (padding,
    each row's last token: the engine's own top-k stands there). None: route afresh."""

    def rows(self, index) -> Batch:
        """The batch's rows at index (a slice or an index tensor), routes included."""
        return Batch(input_ids_BT=self.input_ids_BT[index], response_mask_BT=self.response_mask_BT[index],
                     routes_BTLK=None if self.routes_BTLK is None else self.routes_BTLK[index])


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """One packed micro-batch (remove-padding): whole samples of the batch's rows, their real tokens (prompt then
    response, no padding) concatenated into one row; qualify.case.packing makes it.

    Sample s is packed tokens [cu_seqlens_S1[s], cu_seqlens_S1[s + 1]); its token j is the token at (rows_S[s], j) of
    the padded batch it was packed from. An engine's score() of it returns (1, N) fp32, differentiable:
    logp_1N[0, i] = log p(token i | the earlier tokens of its own sample) (the critic: its value of the state in which
    token i is emitted), 0 at each sample's first token, which has no context. The harness reads the scores of
    response tokens only and unpacks them to (row, position).
    """

    input_ids_1N: torch.Tensor  # (1, N) int64, the samples' real tokens back to back
    position_ids_1N: torch.Tensor  # (1, N) int64, 0..len-1 within each sample
    cu_seqlens_S1: torch.Tensor  # (S + 1,) int32, [0, len_0, len_0 + len_1, ..., N]
    max_seqlen: int
    """The longest sample's length (flash-attention's varlen kernels take it beside cu_seqlens)."""
    rows_S: torch.Tensor  # (S,) int64, the row of the padded batch each sample is, in packed order
    response_mask_1N: torch.Tensor  # (1, N) bool, True on sampled response tokens
    last: bool = True
    """The last micro-batch of the optimizer step on this rank: an engine that accumulates gradients over a step's
    micro-batches reduces them (across TP where needed, summed across DP) after this one's backward()."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_1N.shape[1])

    def sample_starts(self) -> torch.Tensor:
        """(S,) int64 packed index of each sample's first token."""
        return self.cu_seqlens_S1[:-1].long()


@dataclass(frozen=True, slots=True)
class EngineContext:
    """What an engine needs to build its model for one case on one rank."""

    role: str
    """'actor' (causal LM head) or 'critic' (scalar value head)."""
    precision: str
    """'fp32' or 'bf16' (bf16 compute with FP32 master weights and FP32 gradients)."""
    tp: int
    """Tensor-parallel degree (the launch has tp x dp ranks)."""
    rank: int
    """This process's rank in the launch: dp_rank x tp + tp_rank (TP ranks are contiguous)."""
    device: str
    """'cpu' or 'cuda:N'."""
    model_dir: Path
    """HF checkpoint of the role's trainable model."""
    optimizer: Optimizer
    """AdamW settings and the gradient clip of the matrix."""
    temperature: float
    """Sampling temperature: logits are divided by it in fp32 before the fp32 log_softmax."""
    logprob_chunk_tokens: int
    """Tokens per chunk of the fp32 log_softmax."""
    vocab_size: int
    """Real vocabulary size; rows beyond it are padding."""
    work_dir: Path
    """Scratch directory for this case (engine configs, logs)."""
    logprob_formula: str = "full"
    """candidates.logprob_formula: the formula of the logprobs the engine reports through its logprobs() hook
    ('full' or 'processed', qualify.ppo.formula); score() stays the full formula, which the loss is built from."""
    top_k: int = -1
    """The rollout's top-k (-1: off), for the processed formula."""
    top_p: float = 1.0
    """The rollout's top-p (1.0: off), for the processed formula."""
    min_p: float = 0.0
    """The rollout's min-p (0.0: off), for the processed formula."""
    dp: int = 1
    """Data-parallel degree: each DP rank scores its own rows, and the engine sums gradients over the DP ranks (each
    rank's loss is already its share of the step's loss: normalizers are global)."""

    vocab_tile: int | None = None
    """candidates.vocab_tile: the deterministic vocab-parallel logprob path with tiles of this width (torch-tp)."""
    rollout_dir: Path | None = None
    """The sealed rollout the case replays: its rollout.json says how vLLM sampled it (dtype, batch-invariant mode, KV
    block size), which an engine that computes with vLLM's own kernels must follow (qualify.examples.vllm_gpu_exact)."""
    routing: str | None = None
    """rollout.routing of a MoE family: 'replay' (every batch carries the rollout's routes, Batch.routes_BTLK, which
    the actor must route by while its routing weights come from its live router) or 'recompute'; None: dense."""

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    def sampling(self) -> Sampling:
        """The rollout's sampling settings (temperature, top-k, top-p, min-p)."""
        from qualify.ppo.formula import Sampling

        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)
