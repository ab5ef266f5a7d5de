"""Plugin engines with known bugs, named in matrices as 'tests.integration.plugins:<factory>'.

Each is the correct torch-tp engine with one trap from the field put back in. Qualification
must fail for every one of them (negative controls).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from qualify.engines.torch_tp import TorchTPEngine, local
from qualify.examples.own_objective import OwnObjectiveEngine
from qualify.models.hf import scores_from_outputs


class SkipNormAllreduce(TorchTPEngine):
    """Forgets that q_norm/k_norm gradients are partial sums under TP (no all-reduce)."""

    name = "skip-norm-allreduce"
    grad_allreduce_suffixes = ()


class LowPrecisionTemperature(TorchTPEngine):
    """Holds the temperature as a bf16 tensor: bf16 logits are divided by a bf16 temperature, and
    fp32 logits by bf16(T) (0.80078125 for 0.8): wrong whenever T is not exactly representable."""

    name = "bf16-temperature"

    def score(self, batch):
        ids_BT = batch.input_ids_BT.to(self.ctx.device)
        logits_BTV = local(self.compute(input_ids=ids_BT, use_cache=False).logits)
        if self.ctx.role != "actor":
            return super().score(batch)
        scaled_BTV = logits_BTV / torch.tensor(self.ctx.temperature, dtype=torch.bfloat16)
        return scores_from_outputs("actor", scaled_BTV, ids_BT, 1.0, self.ctx.logprob_chunk_tokens,
                                 self.ctx.vocab_size).cpu()


def skip_norm_allreduce() -> TorchTPEngine:
    return SkipNormAllreduce()


def bf16_temperature() -> TorchTPEngine:
    return LowPrecisionTemperature()


# Engines that report logprobs in another formula than the one the matrix declares (candidates.logprob_formula).

class FullWhileDeclaringProcessed(TorchTPEngine):
    """Reports score()'s full-formula logprobs whatever the matrix declares: a trainer that never applies the
    sampler's top-k/top-p, qualified as if it did."""

    def logprobs(self):
        return None


class ProcessedWhileDeclaringFull(TorchTPEngine):
    """Reports the processed formula whatever the matrix declares: a trainer that copies the sampler's truncation
    into its logprobs, qualified as one that computes the full formula."""

    def setup(self, ctx):
        super().setup(replace(ctx, logprob_formula="processed"))


def full_while_declaring_processed() -> TorchTPEngine:
    return FullWhileDeclaringProcessed()


def processed_while_declaring_full() -> TorchTPEngine:
    return ProcessedWhileDeclaringFull()


# Engines that bring their own objective (qualify.examples.own_objective) with a bug in their loss code.

class WrongClipRange(OwnObjectiveEngine):
    """Clips the ratio at 1 +- 1.5 eps (a config read from the wrong place)."""

    def policy_clip(self, ppo):
        return 1.5 * ppo.clip_eps


class NoValueClip(OwnObjectiveEngine):
    """Forgets the value clip: 1/2 (v - R)^2 only."""

    def value_terms(self, values_BT, old_BT, returns_BT, ppo):
        plain_BT = (values_BT - returns_BT).square()
        return plain_BT, plain_BT


class PerSequenceNormalizer(OwnObjectiveEngine):
    """Averages per sequence, then over sequences, where the matrix says global."""

    def normalizer(self, ppo):
        return "per_sequence", None


class PaddingInDenominator(OwnObjectiveEngine):
    """Divides by every position after the prompt, the padding of shorter responses included."""

    def reduce(self, x_BT, mask_BT, normalizer, constant, counts=None):
        if normalizer != "global":
            return super().reduce(x_BT, mask_BT, normalizer, constant, counts)
        after_prompt_BT = mask_BT.cumsum(dim=1) > 0
        return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).sum() / int(after_prompt_BT.sum())


def wrong_clip_range() -> OwnObjectiveEngine:
    return WrongClipRange()


def no_value_clip() -> OwnObjectiveEngine:
    return NoValueClip()


def per_sequence_normalizer() -> OwnObjectiveEngine:
    return PerSequenceNormalizer()


def padding_in_denominator() -> OwnObjectiveEngine:
    return PaddingInDenominator()


# Engines whose numbers break: every one must end with a verdict whose failing rows name the tensor.

NAN_PARAM = "model.layers.0.mlp.down_proj.weight"


class NanGradient(TorchTPEngine):
    """One gradient element turns NaN (an overflow in one kernel); clipping then spreads it everywhere."""

    def backward(self, loss):
        super().backward(loss)
        grad = dict(self.master.named_parameters())[NAN_PARAM].grad
        local(grad).view(-1)[0] = float("nan")


class SkipsNonFiniteStep(NanGradient):
    """Like Megatron and DeepSpeed: a non-finite norm skips the optimizer step (no AdamW state is ever made)."""

    def step(self):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(local(p.grad).float())
                                                     for p in self.master.parameters() if p.grad is not None]))
        if torch.isfinite(norm):
            return super().step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


def nan_gradient() -> TorchTPEngine:
    return NanGradient()


def skips_non_finite_step() -> TorchTPEngine:
    return SkipsNonFiniteStep()


class CrashesInStep(TorchTPEngine):
    """A trainer that crashes in its optimizer step: a rounds run whose training dies in round 0."""

    def step(self):
        raise RuntimeError("the trainer crashed in its optimizer step")


def crashes_in_step() -> TorchTPEngine:
    return CrashesInStep()


# Faults in one decoder layer only: `qualify diagnose` must name that layer and module (negative controls).

class AttentionScaleInLayer(TorchTPEngine):
    """One layer's attention scales q.k by 1.05 / sqrt(head_dim) (a wrong softmax scale in one layer's kernel)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def setup(self, ctx):
        super().setup(ctx)
        attn = self.compute.model.layers[self.layer].self_attn
        attn.scaling = attn.scaling * 1.05


class NormWeightInLayer(TorchTPEngine):
    """One layer's post-attention RMSNorm computes with its weight scaled by 1 + 1e-3 (a perturbed norm weight)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def setup(self, ctx):
        super().setup(ctx)
        norm = self.compute.model.layers[self.layer].post_attention_layernorm
        norm.register_forward_hook(lambda module, args, out: out * (1 + 1e-3))


def attention_scale_layer0() -> TorchTPEngine:
    return AttentionScaleInLayer(0)


def attention_scale_layer1() -> TorchTPEngine:
    return AttentionScaleInLayer(1)


def norm_weight_layer0() -> TorchTPEngine:
    return NormWeightInLayer(0)


def norm_weight_layer1() -> TorchTPEngine:
    return NormWeightInLayer(1)


class LowPrecisionLogSoftmax(TorchTPEngine):
    """Rounds the actor's logprobs to bf16 (a log_softmax kernel run in the compute precision): every logprob is off
    by less than half a bf16 step, well under a bf16 max_abs bound, and systematic."""

    def score(self, batch):
        scores_BT = super().score(batch)
        return scores_BT.to(torch.bfloat16).float() if self.ctx.role == "actor" else scores_BT


def low_precision_log_softmax() -> TorchTPEngine:
    return LowPrecisionLogSoftmax()


# Engines whose reported quantities are not what their own inputs give (qualify.judge.derived must name them).

class OldLogprobsFromOwnForward(OwnObjectiveEngine):
    """Takes the old logprobs from its own forward (old = logp.detach(), TRL's shortcut when it skips the
    recomputation) instead of the rollout's: the ratio is exactly 1 at every token, off the rollout's by the
    train-vs-rollout mismatch (about 2e-6 in fp32), inside the reference's ratio bound."""

    def objective(self, role, ppo, scores_BT, mask_BT, targets):
        if role == "actor":
            targets = dict(targets, old_logprobs_BT=torch.where(mask_BT, scores_BT.detach(), 0.0))
        return super().objective(role, ppo, scores_BT, mask_BT, targets)


def old_logprobs_from_own_forward() -> OwnObjectiveEngine:
    return OldLogprobsFromOwnForward()


class NoDecayOnNorms(TorchTPEngine):
    """Excludes the RMSNorm weights from weight decay (a common trainer default; the matrix's AdamW decays every
    parameter): each norm weight's update is off by lr x weight_decay x |p| (1e-5 here), near the controls' noise."""

    def setup(self, ctx):
        super().setup(ctx)
        o = ctx.optimizer
        norms = [p for n, p in self.master.named_parameters() if "norm" in n]
        rest = [p for n, p in self.master.named_parameters() if "norm" not in n]
        self.optimizer = torch.optim.AdamW([{"params": rest}, {"params": norms, "weight_decay": 0.0}], lr=o.lr,
                                           betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=False)


def no_decay_on_norms() -> TorchTPEngine:
    return NoDecayOnNorms()


class DefaultBetas(TorchTPEngine):
    """Steps AdamW with a trainer's default betas (0.9, 0.95) where the matrix says (0.9, 0.999): the update is still
    AdamW of the engine's own moments, but its second moment is not the declared one of its gradients."""

    def setup(self, ctx):
        super().setup(ctx)
        o = ctx.optimizer
        self.optimizer = torch.optim.AdamW(self.master.parameters(), lr=o.lr, betas=(o.betas[0], 0.95), eps=o.eps,
                                           weight_decay=o.weight_decay, foreach=False)


def default_betas() -> TorchTPEngine:
    return DefaultBetas()


class SplitKHead(TorchTPEngine):
    """Splits the critic's value head matmul over the hidden dimension into a number of parts that follows the row
    count (as a GEMM library picks its split-K by shape): each row's value then depends on how many rows share its
    batch. Correct to fp32 rounding, so it passes the bounds; it must fail a declared layout invariance. The actor is
    torch-tp's own."""

    def setup(self, ctx):
        super().setup(ctx)
        if ctx.role != "critic":
            return
        head = self.compute.score

        def split_k(x, head=head):
            x, weight = local(x), local(head.weight)
            parts = 1 + (x.shape[0] * x.shape[1]) % 3
            out = sum(torch.nn.functional.linear(x[..., c], weight[:, c])
                      for c in torch.arange(x.shape[-1]).chunk(parts))
            return out + local(head.bias) if head.bias is not None else out

        head.forward = split_k


def split_k_head() -> TorchTPEngine:
    return SplitKHead()


class FusedAdamStep(torch.optim.Optimizer):
    """AdamW in the form of apex's and Transformer Engine's FusedAdam (adam_w_mode), which Megatron uses: the moments
    in fp32 as torch keeps them, then the bias-corrected update and the decoupled decay folded into one expression,
    p - lr x (m_hat / (sqrt(v_hat) + eps) + wd x p), evaluated in float64 and rounded to the parameter once. Correct:
    it differs from torch's AdamW (decay, then addcdiv: two roundings) only in where it rounds."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v, k = state["exp_avg"], state["exp_avg_sq"], state["step"]
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat, v_hat = m.double() / (1 - b1 ** k), v.double() / (1 - b2 ** k)
                new = p.double() - group["lr"] * (m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p.double())
                p.copy_(new.to(p.dtype))


class FusedAdamForm(TorchTPEngine):
    """The correct torch-tp engine with a FusedAdam-form optimizer (FusedAdamStep): a correct twin, not a bug; it must
    pass."""

    def setup(self, ctx):
        super().setup(ctx)
        o = ctx.optimizer
        self.optimizer = FusedAdamStep(self.master.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                       weight_decay=o.weight_decay)


def fused_adam_form() -> TorchTPEngine:
    return FusedAdamForm()


class BiasGradSummedOverTwo(TorchTPEngine):
    """The critic's value-head bias gradient twice what the loss gives (a bias summed over two data-parallel replicas
    where the rest is averaged): every other tensor is right, and the bias gradient's control error is now raised to
    the sum of |per-token differences| (qualify.ppo.decisions.bias_terms), which this still fails by far."""

    def setup(self, ctx):
        super().setup(ctx)
        for name, p in self.compute.named_parameters():
            if name == "score.bias":
                p.register_hook(lambda g: 2 * g)


def bias_grad_summed_over_two() -> TorchTPEngine:
    return BiasGradSummedOverTwo()


# Engines without a logits() hook: their logprobs cannot be derived from their own logits, so the derivation row fails
# naming the hook unless the matrix waives the check for them (candidates.waive: qualify.waivers).

class NoLogitsHook(TorchTPEngine):
    """The correct torch-tp engine without the logits() hook: it must fail unless the matrix waives
    sampler_derivation for it, and pass with the waiver."""

    logits = None  # the hook is absent: the worker records no derivation (qualify.candidate.worker.own_logits_check)


class Bf16LogsumexpWithoutLogits(NoLogitsHook):
    """Computes the actor's logprobs as fp32 logits / T minus a log-sum-exp taken in bf16 (a fused kernel that reduces
    in the compute precision), and has no logits() hook to derive them from: every logprob is off by up to half a bf16
    step of the log-sum-exp, the same for every token of a position."""

    def score(self, batch):
        if self.ctx.role != "actor":
            return super().score(batch)
        ids_BT = batch.input_ids_BT.to(self.ctx.device)
        x_BTV = local(self.compute(input_ids=ids_BT, use_cache=False).logits)[:, :-1, :self.ctx.vocab_size]
        x_BTV = x_BTV.float() / torch.tensor(self.ctx.temperature, dtype=torch.float32)
        lse_BT = torch.logsumexp(x_BTV.to(torch.bfloat16), dim=-1).float()
        logp_BT = x_BTV.gather(-1, ids_BT[:, 1:, None]).squeeze(-1) - lse_BT
        return torch.nn.functional.pad(logp_BT, (1, 0)).cpu()


def no_logits_hook() -> TorchTPEngine:
    return NoLogitsHook()


def bf16_logsumexp_without_logits() -> TorchTPEngine:
    return Bf16LogsumexpWithoutLogits()
