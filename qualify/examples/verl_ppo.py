"""verl's PPO and GRPO losses qualified as an engine's own objective: the torch-tp engine for the model, verl's own loss
code for the loss (verl 0.9.1 from PyPI, `verl.trainer.ppo.core_algos`; a test dependency of qualify), composed as
verl's engine workers compose it (`verl.workers.utils.losses.ppo_loss` and `value_loss`).

Name it in a PPO matrix (actor and critic) or a GRPO matrix (actor) as `qualify.examples.verl_ppo:engine` (any TP,
any DP, padded or packed). verl's settings are mapped from the matrix, into verl's own `ActorConfig`/`CriticConfig`:

    verl                                   matrix
    actor/critic loss_agg_mode
      'token-mean' (verl's default)        ppo.token_normalizer global; GRPO: grpo.aggregation token_mean
      'seq-mean-token-mean'                ppo.token_normalizer per_sequence; grpo.aggregation seq_mean_token_mean
      'seq-mean-token-sum-norm'            GRPO: grpo.aggregation seq_mean_token_sum_norm, loss_scale_factor =
                                           grpo.constant. PPO: token_normalizer constant, loss_scale_factor =
                                           ppo.normalizer_constant / global_batch_size (verl divides the token sum
                                           by global_batch_size x loss_scale_factor, the matrix by the constant)
      ('token-sum', 'seq-mean-token-sum'   no matrix setting: only reachable through mismatched-style overrides)
    policy_loss.loss_mode 'vanilla'        the clipped surrogate (compute_policy_loss_vanilla)
    clip_ratio, clip_ratio_low             ppo.clip_eps_low (ppo.clip_eps unless set)
    clip_ratio_high                        ppo.clip_eps_high (ppo.clip_eps unless set)
    clip_ratio_c (dual clip, verl 3.0)     ppo.dual_clip_c; null (off) maps to clip_ratio_c = inf: verl has no off
                                           switch, and with inf the dual-clip branch min(-A c, pg) never takes
    critic cliprange_value                 ppo.value_clip_eps (compute_value_loss: 0.5 x agg of the clipped max)
    use_kl_loss, kl_loss_coef              GRPO: grpo.kl_coef > 0 (the KL in the loss, aggregated as the loss)
    kl_loss_type 'k1', 'k2', 'low_var_kl'  grpo.kl_estimator k1, k2, k3 (kl_penalty; verl's k3 clamps the log
                                           ratio to +-20 and the estimate to +-10)
    algorithm.kl_penalty 'kl' (k1)         PPO: the KL folded into the rewards (ppo.kl_coef): already in the frozen
                                           advantages; the adapter reports kl_BT = kl_penalty(logp, ref, 'kl')
    actor/pg_clipfrac + pg_clipfrac_lower  clip_frac: verl's per-token clip indicator (either edge, or the dual
                                           clip), aggregated by agg_loss as the loss is (PPO's clip_frac; GRPO's
                                           grpo.clip_frac loss_weighted) or as a token mean (grpo.clip_frac
                                           token_mean, what verl logs)
    refused in one line: ppo.entropy_coef > 0 (this adapter maps no entropy bonus: unset it) and
    grpo.kl_estimator k3_ratio (verl has no ratio-weighted KL)

Data parallelism as verl runs it: its engines give agg_loss the step's global counts (`batch_num_tokens`: the active
tokens all-reduced over the DP group; `global_batch_size`: the mini-batch's sequences) and `dp_size`, and agg_loss
multiplies by dp_size because FSDP/DDP average the ranks' gradients. The harness's engines sum each rank's share
instead, so the adapter passes verl the step's counts from `share.normalizers` (num_active_tokens; and
num_active_sequences, the mini-batch's sequences whenever every row holds a response token, as a rollout's rows do)
with the case's DP degree, and takes verl's loss divided by dp_size: exactly the rank's share of the step's loss
(the same holds for each micro-batch of a packed case, whose share carries the step's normalizers).

The loss, and through it every gradient, is verl's code; the judged outputs are the tensors verl's loss reads and
what it reports (per row, `seq_loss_B` is verl's loss of that row alone with the step's counts). `mismatched()`
makes the same engine with one verl setting changed away from the matrix: qualification must then fail naming the
tensors that setting moves.
"""

from __future__ import annotations

from typing import Any

import torch

from qualify.engines.torch_tp import TorchTPEngine
from qualify.ppo.math import policy_settings
from qualify.ppo.share import count_normalizers

AGG_MODES = {"global": "token-mean", "per_sequence": "seq-mean-token-mean", "constant": "seq-mean-token-sum-norm",
             "token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean",
             "seq_mean_token_sum_norm": "seq-mean-token-sum-norm"}
"""The matrix's ppo.token_normalizer (PPO) and grpo.aggregation (GRPO) as verl's loss_agg_mode."""
KL_LOSS_TYPES = {"k1": "k1", "k2": "k2", "k3": "low_var_kl"}
"""grpo.kl_estimator as verl's kl_loss_type (verl's default 'low_var_kl' is k3)."""


def verl_settings(role: str, ppo: Any, grpo: Any = None, changed: dict[str, Any] | None = None) -> dict[str, Any]:
    """verl's settings (its ActorConfig/CriticConfig field names) for the matrix's ppo (and grpo) sections, then the
    changed ones. A matrix setting verl cannot express is refused in one line (ValueError)."""
    policy = policy_settings(ppo)
    if policy.entropy_coef != 0:
        raise ValueError("the verl adapter maps no entropy bonus (ppo.entropy_coef): unset it")
    if grpo is not None:
        if role != "actor":
            raise ValueError(f"GRPO trains the actor alone, not the {role}")
        if grpo.kl_estimator not in KL_LOSS_TYPES:
            raise ValueError(f"verl's kl_loss_type has no {grpo.kl_estimator} (it has k1, k2, k3 = low_var_kl): set "
                             "grpo.kl_estimator to one of those")
        settings = {"loss_agg_mode": AGG_MODES[grpo.aggregation], "loss_scale_factor": grpo.constant,
                    "use_kl_loss": grpo.kl_coef > 0, "kl_loss_coef": grpo.kl_coef,
                    "kl_loss_type": KL_LOSS_TYPES[grpo.kl_estimator],
                    "clip_frac_mode": "token-mean" if grpo.clip_frac == "token_mean" else "loss"}
    else:
        settings = {"loss_agg_mode": AGG_MODES[ppo.token_normalizer], "use_kl_loss": False, "kl_loss_coef": 0.0,
                    "kl_loss_type": "k1", "clip_frac_mode": "loss",
                    # verl's sum-norm divides by global_batch_size x loss_scale_factor: set per step (verl_info)
                    "normalizer_constant": ppo.normalizer_constant}
    if role == "actor":
        settings |= {"clip_ratio": policy.low, "clip_ratio_low": policy.low, "clip_ratio_high": policy.high,
                     "clip_ratio_c": float("inf") if policy.dual_c is None else policy.dual_c}
    else:
        settings |= {"cliprange_value": ppo.value_clip_eps}
    return settings | dict(changed or {})


def verl_info(settings: dict[str, Any], num_tokens: int, num_sequences: int, dp: int) -> dict[str, Any]:
    """agg_loss's global-batch arguments (verl's config.global_batch_info) for a step of these counts on dp ranks."""
    scale = settings.get("loss_scale_factor")
    if settings.get("normalizer_constant") is not None:  # PPO's constant normalizer (module docstring)
        scale = settings["normalizer_constant"] / max(num_sequences, 1)
    return {"dp_size": dp, "batch_num_tokens": max(num_tokens, 1), "global_batch_size": max(num_sequences, 1),
            "loss_scale_factor": scale}


def verl_config(role: str, settings: dict[str, Any]) -> Any:
    """verl's own ActorConfig (or CriticConfig) holding the settings."""
    from verl.workers.config import ActorConfig, CriticConfig

    common = {"strategy": "fsdp", "ppo_mini_batch_size": 1, "ppo_micro_batch_size_per_gpu": 1, "rollout_n": 1,
              "loss_agg_mode": settings["loss_agg_mode"]}
    if role == "critic":
        return CriticConfig(**common, cliprange_value=settings["cliprange_value"])
    return ActorConfig(**common, clip_ratio=settings["clip_ratio"], clip_ratio_low=settings["clip_ratio_low"],
                       clip_ratio_high=settings["clip_ratio_high"], clip_ratio_c=settings["clip_ratio_c"],
                       use_kl_loss=settings["use_kl_loss"], kl_loss_coef=settings["kl_loss_coef"],
                       kl_loss_type=settings["kl_loss_type"])


def verl_policy_loss(config: Any, settings: dict[str, Any], logp_BT: torch.Tensor, old_BT: torch.Tensor,
                     ref_BT: torch.Tensor, adv_BT: torch.Tensor,
                     mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """(policy loss, pg loss, kl loss, verl's metrics) as verl.workers.utils.losses.ppo_loss composes them:
    pg_loss from compute_policy_loss_vanilla, plus kl_loss_coef x agg_loss(kl_penalty) with use_kl_loss. Each is
    verl's (x dp_size, the step's global counts in config.global_batch_info)."""
    from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss_vanilla, kl_penalty

    pg_loss, metrics = compute_policy_loss_vanilla(old_log_prob=old_BT, log_prob=logp_BT, advantages=adv_BT,
                                                   response_mask=mask_BT, loss_agg_mode=config.loss_agg_mode,
                                                   config=config)
    kl_loss = torch.zeros_like(pg_loss)
    if config.use_kl_loss:
        kld_BT = kl_penalty(logprob=logp_BT, ref_logprob=ref_BT, kl_penalty=config.kl_loss_type)
        kl_loss = agg_loss(loss_mat=kld_BT, loss_mask=mask_BT, loss_agg_mode=config.loss_agg_mode,
                           **config.global_batch_info)
    return pg_loss + kl_loss * config.kl_loss_coef, pg_loss, kl_loss, metrics


def policy_clipped(ratio_BT: torch.Tensor, adv_BT: torch.Tensor, settings: dict[str, Any]) -> torch.Tensor:
    """verl's per-token clip indicator (compute_policy_loss_vanilla's pg_clipfrac and pg_clipfrac_lower, before
    their token means): the clipped term is the larger, or (A < 0) the dual clip's -A c is the smaller."""
    pg1_BT = -adv_BT * ratio_BT
    pg2_BT = -adv_BT * torch.clamp(ratio_BT, 1 - settings["clip_ratio_low"], 1 + settings["clip_ratio_high"])
    clipped_BT = torch.maximum(pg1_BT, pg2_BT)
    lower_BT = (adv_BT < 0) & torch.gt(clipped_BT, -adv_BT * settings["clip_ratio_c"])
    return (torch.gt(pg2_BT, pg1_BT) | lower_BT).to(ratio_BT.dtype)


class VerlPPOEngine(TorchTPEngine):
    """torch-tp whose objective is verl's PPO/GRPO loss (see the module docstring)."""

    name = "verl-ppo"
    packed = True  # the objective reads the unpacked (row, position) scores: packed cases are padded ones to it

    def __init__(self, changed: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.changed = dict(changed or {})

    def objective(self, role: str, ppo: Any, scores_BT: torch.Tensor, mask_BT: torch.Tensor,
                  targets: dict[str, torch.Tensor], *, grpo: Any = None,
                  share: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        settings = verl_settings(role, ppo, grpo, self.changed)
        norms = count_normalizers(mask_BT) if share is None else share.normalizers
        dp = self.ctx.dp if share is not None else 1
        info = verl_info(settings, int(norms.num_active_tokens), int(norms.num_active_sequences), dp)
        config = verl_config(role, settings)
        if role == "actor":  # as verl.workers.utils.losses.ppo_loss sets it per micro-batch (value_loss passes info)
            config.global_batch_info.update(info)
        # verl's padded tensors hold 0 off the response mask (no_padding_2_padding); so do these
        zero = torch.zeros_like(scores_BT)
        scores_BT = torch.where(mask_BT, scores_BT, zero)
        t = {k: torch.where(mask_BT, v.to(scores_BT.dtype), zero) for k, v in targets.items() if k.endswith("_BT")}
        if role == "critic":
            return self.critic(config, settings, info, scores_BT, mask_BT, t)
        adv_BT = t["advantages_BT"] if grpo is None else torch.where(
            mask_BT, share.advantages_B[:, None].to(scores_BT.dtype), zero)
        loss, _, _, _ = verl_policy_loss(config, settings, scores_BT, t["old_logprobs_BT"], t["ref_logprobs_BT"],
                                         adv_BT, mask_BT)
        # verl's loss x dp_size is for gradients averaged over DP; the engine sums the ranks': the share is / dp
        return loss / dp, self.actor_outputs(config, settings, info, scores_BT, mask_BT, t, adv_BT, grpo, share)

    @staticmethod
    def critic(config: Any, settings: dict[str, Any], info: dict[str, Any], values_BT: torch.Tensor,
               mask_BT: torch.Tensor, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """verl's compute_value_loss (as verl.workers.utils.losses.value_loss calls it); clip_frac its per-token
        indicator aggregated as the loss."""
        from verl.trainer.ppo.core_algos import agg_loss, compute_value_loss
        from verl.utils.torch_functional import clip_by_value

        eps = config.cliprange_value
        loss, _ = compute_value_loss(vpreds=values_BT, returns=t["returns_BT"], values=t["old_values_BT"],
                                     response_mask=mask_BT, cliprange_value=eps, loss_agg_mode=config.loss_agg_mode,
                                     **info)
        with torch.no_grad():
            v, old, ret = values_BT.detach(), t["old_values_BT"], t["returns_BT"]
            clipped_BT = torch.gt((clip_by_value(v, old - eps, old + eps) - ret) ** 2, (v - ret) ** 2).to(v.dtype)
            clip_frac = agg_loss(loss_mat=clipped_BT, loss_mask=mask_BT, loss_agg_mode=config.loss_agg_mode, **info)
        return loss / info["dp_size"], {"values_BT": v, "clip_frac": clip_frac / info["dp_size"]}

    @staticmethod
    def actor_outputs(config: Any, settings: dict[str, Any], info: dict[str, Any], logp_BT: torch.Tensor,
                      mask_BT: torch.Tensor, t: dict[str, torch.Tensor], adv_BT: torch.Tensor, grpo: Any,
                      share: Any) -> dict[str, torch.Tensor]:
        """The tensors verl's loss reads and what it reports, as the judged outputs: this rank's rows, and scalars as
        its share of the step's (verl's aggregate with the step's counts / dp_size)."""
        from verl.trainer.ppo.core_algos import agg_loss, kl_penalty

        dp = info["dp_size"]
        with torch.no_grad():
            d = logp_BT.detach()
            ratio_BT = torch.where(mask_BT, torch.exp(torch.clamp(d - t["old_logprobs_BT"], -20.0, 20.0)), 0.0)
            kl_type = "kl" if grpo is None else config.kl_loss_type
            kl_BT = torch.where(mask_BT, kl_penalty(logprob=d, ref_logprob=t["ref_logprobs_BT"], kl_penalty=kl_type),
                                0.0)
            clip_mode = config.loss_agg_mode if settings["clip_frac_mode"] == "loss" else "token-mean"
            clip_frac = agg_loss(loss_mat=policy_clipped(ratio_BT, adv_BT, settings), loss_mask=mask_BT,
                                 loss_agg_mode=clip_mode, **info) / dp
            out = {"logprobs_BT": d, "ratio_BT": ratio_BT, "kl_BT": kl_BT, "clip_frac": clip_frac}
            if grpo is None:  # PPO reports the KL's token mean over the step
                return out | {"kl_mean": agg_loss(loss_mat=kl_BT, loss_mask=mask_BT, loss_agg_mode="token-mean",
                                                  **info) / dp}
            _, pg_loss, kl_loss, _ = verl_policy_loss(config, settings, d, t["old_logprobs_BT"],
                                                      t["ref_logprobs_BT"], adv_BT, mask_BT)
            rows = [verl_policy_loss(config, settings, *(x[b:b + 1] for x in (d, t["old_logprobs_BT"],
                                                                              t["ref_logprobs_BT"], adv_BT, mask_BT)))[0]
                    for b in range(mask_BT.shape[0])]
            return out | {"kl_mean": kl_loss / dp, "policy_loss": pg_loss / dp,
                          "advantages_B": share.advantages_B.detach().to(d.dtype),
                          "seq_loss_B": torch.stack(rows).reshape(-1).to(d.dtype) / dp}


def engine() -> VerlPPOEngine:
    """verl's PPO/GRPO loss with its settings mapped from the matrix."""
    return VerlPPOEngine()


def mismatched() -> VerlPPOEngine:
    """verl's loss_agg_mode 'seq-mean-token-mean' (a mean over sequences of each sequence's token mean) where the
    matrix says a token mean: must fail, naming the loss and the gradients from step 0 (the clip fraction, the
    moved logprobs or values from step 1)."""
    return VerlPPOEngine({"loss_agg_mode": "seq-mean-token-mean"})
