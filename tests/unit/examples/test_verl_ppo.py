"""The verl adapter (qualify.examples.verl_ppo, verl 0.9.1's own core_algos) on fixed tensors: its settings mapping
from the matrix, the refusals of what verl cannot express, and its objective against qualify's own (loss, outputs,
logprob/value gradients) for every normalizer and aggregation, at DP1 and as two DP ranks' shares; each check with a
negative control that the same comparison catches."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from qualify.matrix import GRPO, PPO, load_matrix
from qualify.ppo.objective import grpo_share, ppo_share, role_objective
from qualify.ppo.share import Normalizers

pytest.importorskip("verl.trainer.ppo.core_algos")

from qualify.examples.verl_ppo import VerlPPOEngine, mismatched, verl_settings

REPO = Path(__file__).resolve().parents[3]
ROWS, POS, G = 8, 6, 4
LENGTHS = [6, 5, 5, 4, 3, 2, 2, 2]  # rank 0 (rows 0-3) 20 tokens, rank 1 9: unequal


def inputs():
    gen = torch.Generator().manual_seed(5)
    mask_BT = torch.arange(POS)[None, :] < torch.tensor(LENGTHS)[:, None]
    logp_BT = -torch.rand(ROWS, POS, generator=gen) * 3
    values_BT = torch.randn(ROWS, POS, generator=gen)
    targets = {"old_logprobs_BT": logp_BT + 0.5 * torch.randn(ROWS, POS, generator=gen),
               "ref_logprobs_BT": logp_BT + 0.2 * torch.randn(ROWS, POS, generator=gen),
               "advantages_BT": torch.randn(ROWS, POS, generator=gen) * mask_BT,
               "returns_BT": values_BT + 0.4 * torch.randn(ROWS, POS, generator=gen),
               "old_values_BT": values_BT + 0.3 * torch.randn(ROWS, POS, generator=gen),
               "score_B": torch.randn(ROWS, generator=gen)}
    # garbage off the mask must not reach verl's arithmetic
    return mask_BT, torch.where(mask_BT, logp_BT, float("inf")), torch.where(mask_BT, values_BT, float("nan")), targets


def adapter(engine: VerlPPOEngine, dp: int = 1) -> VerlPPOEngine:
    engine.ctx = SimpleNamespace(dp=dp, dp_rank=0)
    return engine


PPOS = {"global": PPO(clip_eps=0.2, dual_clip_c=2.0), "per_sequence": PPO(clip_eps=0.2, token_normalizer="per_sequence"),
        "constant": PPO(clip_eps=0.2, clip_eps_high=0.28, token_normalizer="constant", normalizer_constant=24.0)}
GRPOS = {"token_mean": GRPO(group_size=G, kl_coef=0.04),
         "seq_mean_token_mean": GRPO(group_size=G, kl_coef=0.04, aggregation="seq_mean_token_mean", kl_estimator="k2"),
         "seq_mean_token_sum_norm": GRPO(group_size=G, kl_coef=0.04, aggregation="seq_mean_token_sum_norm",
                                         constant=6.0, clip_frac="token_mean", kl_estimator="k1")}


def test_settings_map_the_matrix_onto_verls_fields():
    ppo = verl_settings("actor", PPO(clip_eps=0.2))
    assert ppo["loss_agg_mode"] == "token-mean" and ppo["clip_ratio_c"] == float("inf") and not ppo["use_kl_loss"]
    assert (ppo["clip_ratio_low"], ppo["clip_ratio_high"]) == (0.2, 0.2)
    dual = verl_settings("actor", PPO(clip_eps=0.2, clip_eps_low=0.1, clip_eps_high=0.28, dual_clip_c=3.0))
    assert (dual["clip_ratio_low"], dual["clip_ratio_high"], dual["clip_ratio_c"]) == (0.1, 0.28, 3.0)
    assert verl_settings("critic", PPO(value_clip_eps=0.3, token_normalizer="per_sequence")) == {
        "loss_agg_mode": "seq-mean-token-mean", "use_kl_loss": False, "kl_loss_coef": 0.0, "kl_loss_type": "k1",
        "clip_frac_mode": "loss", "normalizer_constant": None, "cliprange_value": 0.3}
    grpo = verl_settings("actor", PPO(), GRPOS["seq_mean_token_sum_norm"])
    assert (grpo["loss_agg_mode"], grpo["loss_scale_factor"], grpo["kl_loss_type"], grpo["clip_frac_mode"]) == (
        "seq-mean-token-sum-norm", 6.0, "k1", "token-mean")
    assert verl_settings("actor", PPO(), GRPO(group_size=G))["kl_loss_type"] == "low_var_kl"
    # negative control: the mismatched engine's one change shows through the same mapping
    assert verl_settings("actor", PPO(), changed=mismatched().changed)["loss_agg_mode"] == "seq-mean-token-mean"


@pytest.mark.parametrize(("matrix", "section", "changed", "says"), [
    ("tiny-qwen3.yaml", "ppo", {"entropy_coef": 0.01}, "maps no entropy bonus"),
    ("tiny-qwen3-grpo.yaml", "grpo", {"kl_estimator": "k3_ratio"}, "verl's kl_loss_type has no k3_ratio"),
])
def test_what_verl_cannot_express_is_refused_in_one_line(tmp_path, matrix, section, changed, says):
    """The shipped matrices with one setting verl cannot express: refused in one line; as shipped (the negative
    control) every role of theirs maps."""
    data = yaml.safe_load((REPO / "matrices" / matrix).read_text())
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(data))
    shipped = load_matrix(path)
    for role in shipped.candidates.roles:
        assert verl_settings(role, shipped.ppo, shipped.grpo)["loss_agg_mode"] == "token-mean"
    data[section].update(changed)
    path.write_text(yaml.safe_dump(data))
    m = load_matrix(path)
    with pytest.raises(ValueError) as refused:
        verl_settings("actor", m.ppo, m.grpo)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def check_against_reference(role, ppo, grpo, engine, rows=slice(None), dp=1, share=None):
    """(loss, outputs, gradient of the scores) of the adapter and of qualify's own objective on rows."""
    mask_BT, logp_BT, values_BT, targets = inputs()
    scores = (logp_BT if role == "actor" else values_BT)[rows]
    mine = {k: v[rows] for k, v in targets.items()}
    got_in, ref_in = scores.clone().requires_grad_(), torch.where(mask_BT[rows], scores, 0.0).requires_grad_()
    loss, out = adapter(engine, dp).objective(role, ppo, got_in, mask_BT[rows], mine, grpo=grpo, share=share)
    loss.backward()
    ref_loss, ref_out = role_objective(role, ppo, ref_in, mask_BT[rows], mine, grpo=grpo, share=share)
    ref_loss.backward()
    return (loss.detach(), out, torch.nan_to_num(got_in.grad)), (ref_loss.detach(), ref_out, ref_in.grad)


def assert_same(got, ref):
    (loss, out, grad), (ref_loss, ref_out, ref_grad) = got, ref
    assert set(out) == set(ref_out)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-8)
    for name in ref_out:
        torch.testing.assert_close(out[name], ref_out[name].to(out[name].dtype), rtol=1e-6, atol=1e-7, msg=name)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("normalizer", list(PPOS))
def test_ppo_objective_is_qualifys_and_the_mismatched_one_is_not(role, normalizer):
    ppo = PPOS[normalizer]
    assert_same(*check_against_reference(role, ppo, None, VerlPPOEngine(), share=ppo_share(inputs()[0])))
    changed = "token-mean" if normalizer == "per_sequence" else "seq-mean-token-mean"
    (loss, _, grad), (ref_loss, _, ref_grad) = check_against_reference(
        role, ppo, None, VerlPPOEngine({"loss_agg_mode": changed}), share=ppo_share(inputs()[0]))
    assert abs(float(loss - ref_loss)) > 1e-3 * abs(float(ref_loss))  # the negative control: caught by far
    assert float((grad - ref_grad).abs().max()) > 1e-3 * float(ref_grad.abs().max())


@pytest.mark.parametrize("aggregation", list(GRPOS))
def test_grpo_objective_is_qualifys_and_a_changed_kl_type_is_not(aggregation):
    grpo = GRPOS[aggregation]
    mask_BT, _, _, targets = inputs()
    share = grpo_share(grpo, targets["score_B"], mask_BT)
    assert_same(*check_against_reference("actor", PPO(clip_eps=0.2, dual_clip_c=3.0), grpo, VerlPPOEngine(),
                                         share=share))
    other = "k1" if grpo.kl_estimator != "k1" else "low_var_kl"
    (_, out, _), (_, ref_out, _) = check_against_reference("actor", PPO(clip_eps=0.2), grpo,
                                                           VerlPPOEngine({"kl_loss_type": other}), share=share)
    assert float((out["kl_BT"] - ref_out["kl_BT"]).abs().max()) > 1e-3


def test_clip_indicator_is_verls_logged_clip_fraction():
    """The adapter's per-token clip indicator, as a token mean, is verl's pg_clipfrac + pg_clipfrac_lower."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    from qualify.examples.verl_ppo import policy_clipped, verl_config

    mask_BT, logp_BT, _, t = inputs()
    logp_BT = torch.where(mask_BT, logp_BT, 0.0)
    adv_BT = torch.where(mask_BT, t["advantages_BT"] * 4, 0.0)  # large enough that the dual clip takes somewhere
    settings = verl_settings("actor", PPO(clip_eps=0.2, dual_clip_c=1.5))
    config = verl_config("actor", settings)
    config.global_batch_info.update(dp_size=1)
    _, metrics = compute_policy_loss_vanilla(t["old_logprobs_BT"], logp_BT, adv_BT, mask_BT, "token-mean", config)
    ratio_BT = torch.exp(logp_BT - t["old_logprobs_BT"])
    mine = policy_clipped(ratio_BT, adv_BT, settings)[mask_BT].mean()
    assert metrics["actor/pg_clipfrac_lower"] > 0 and metrics["actor/pg_clipfrac"] > 0
    assert float(mine) == pytest.approx(metrics["actor/pg_clipfrac"] + metrics["actor/pg_clipfrac_lower"], rel=1e-6)
    # negative control: without the dual clip's tokens it is verl's pg_clipfrac alone, off by the lower fraction
    plain = policy_clipped(ratio_BT, adv_BT, settings | {"clip_ratio_c": float("inf")})[mask_BT].mean()
    assert float(mine - plain) == pytest.approx(metrics["actor/pg_clipfrac_lower"], rel=1e-6)


@pytest.mark.parametrize(("role", "ppo", "grpo"), [("actor", PPOS["global"], None), ("critic", PPOS["per_sequence"], None),
                                                   ("actor", PPO(clip_eps=0.2), GRPOS["seq_mean_token_mean"])])
def test_two_dp_ranks_shares_sum_to_the_steps_loss(role, ppo, grpo):
    """Each rank passes verl the step's counts and dp_size 2 and takes verl's loss / 2: the shares sum to the whole
    step's loss and the rows' gradients are the step's. Negative control: verl's loss as it is (x dp_size, for
    gradients averaged over DP) sums to twice the step's."""
    mask_BT, _, _, targets = inputs()
    counts = Normalizers(mask_BT.sum(), mask_BT.any(-1).sum())
    whole, whole_ref = check_against_reference(role, ppo, grpo, VerlPPOEngine(), share=(
        grpo_share(grpo, targets["score_B"], mask_BT) if grpo else ppo_share(mask_BT)))
    assert_same(whole, whole_ref)
    losses, grads = [], []
    for rows in (slice(0, 4), slice(4, 8)):
        share = ppo_share(mask_BT)._replace(normalizers=counts) if grpo is None else grpo_share(
            grpo, targets["score_B"], mask_BT)._replace(normalizers=counts)
        if grpo is not None:
            share = share._replace(advantages_B=share.advantages_B[rows])
        (loss, _, grad), _ = check_against_reference(role, ppo, grpo, VerlPPOEngine(), rows, dp=2, share=share)
        losses.append(loss)
        grads.append(grad)
    torch.testing.assert_close(sum(losses), whole[0], rtol=1e-6, atol=1e-7)  # a sum of terms of either sign
    torch.testing.assert_close(torch.cat(grads), whole[2], rtol=1e-5, atol=1e-8)
    assert float(sum(losses) * 2) != pytest.approx(float(whole[0]), rel=1e-3)  # verl's own x dp_size, unscaled
