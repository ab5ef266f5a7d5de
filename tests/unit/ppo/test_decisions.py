"""Clip decisions read back from recorded outputs (qualify.ppo.decisions), imposed decisions in the objectives, the
reference replayed on imposed decisions (qualify.reference.step.run_role(decided=...)) and the decision rows
(qualify.judge.decided)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from qualify.judge.decided import decision_rows
from qualify.layout import RunLayout
from qualify.matrix import load_matrix
from qualify.models import hf
from qualify.models.tiny import build_tiny_model
from qualify.ppo.decisions import decisions, differing
from qualify.ppo.grpo import grpo_loss, token_advantages
from qualify.ppo.math import clipped_policy_loss, clipped_value_loss
from qualify.ppo.share import count_normalizers
from qualify.reference.context import ScoringContext
from qualify.reference.step import Control, run_role

PPO = SimpleNamespace(clip_eps=0.2, value_clip_eps=0.2)


def _data(seed: int = 0, B: int = 6, T: int = 30):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.2
    old = torch.randn(B, T, generator=g)
    values = old + 0.3 * torch.randn(B, T, generator=g)  # many tokens beyond old +- 0.2
    returns = torch.randn(B, T, generator=g)
    ratio = torch.exp(0.3 * torch.randn(B, T, generator=g))
    adv = torch.randn(B, T, generator=g)
    return mask, old, values, returns, ratio, adv


def test_critic_decisions_reproduce_the_value_loss_clip_frac_and_its_per_token_choice():
    mask, old, values, returns, *_ = _data()
    d = decisions("critic", PPO, None, {"values_BT": values * mask}, {"old_values_BT": old, "returns_BT": returns}, mask)
    _, clip_frac = clipped_value_loss(values, old, returns, mask, 0.2, "global")
    assert 0 < int(d.clipped_BT.sum()) < int(mask.sum())
    assert float(d.clipped_BT.sum()) / float(mask.sum()) == pytest.approx(float(clip_frac), abs=1e-7)
    for b in range(mask.shape[0]):  # an obvious loop: the clipped term is the larger one
        for t in range(mask.shape[1]):
            v, o, r = float(values[b, t]), float(old[b, t]), float(returns[b, t])
            vc = o + min(max(v - o, -0.2), 0.2)
            assert bool(d.clipped_BT[b, t]) == (bool(mask[b, t]) and (vc - r) ** 2 > (v - r) ** 2)


def test_actor_decisions_reproduce_the_surrogate_clip_frac_for_ppo_and_grpo():
    mask, _, _, _, ratio, adv = _data(1)
    logp = torch.log(ratio)
    old = torch.zeros_like(logp)
    _, ratio_BT, clip_frac = clipped_policy_loss(logp, old, adv, mask, 0.2, "global")
    d = decisions("actor", PPO, None, {"ratio_BT": ratio_BT * mask}, {"advantages_BT": adv}, mask)
    assert float(d.clipped_BT.sum()) / float(mask.sum()) == pytest.approx(float(clip_frac), abs=1e-7)
    adv_B = torch.randn(mask.shape[0])
    out = grpo_loss(logp, old, None, token_advantages(adv_B, mask), mask, clip_eps=0.2, kl_coef=0.0,
                    aggregation="token_mean", normalizers=count_normalizers(mask))
    g = decisions("actor", PPO, SimpleNamespace(), {"ratio_BT": out.ratio_BT * mask, "advantages_B": adv_B}, {}, mask)
    expect = (-token_advantages(adv_B, mask) * torch.clamp(out.ratio_BT, 0.8, 1.2) > -token_advantages(adv_B, mask)
              * out.ratio_BT) & mask
    assert torch.equal(g.clipped_BT, expect) and int(expect.sum()) > 0


@pytest.mark.parametrize("role", ["critic", "actor"])
def test_a_decision_never_changes_within_its_margin(role):
    """The margin is how far the deciding quantity must move to change the decision: moving it by less never does
    (so a flip whose reference margin exceeds the bound needs an error beyond the bound)."""
    mask, old, values, returns, ratio, adv = _data(2)
    quantity = "values_BT" if role == "critic" else "ratio_BT"
    base = values if role == "critic" else ratio
    targets = {"old_values_BT": old, "returns_BT": returns, "advantages_BT": adv}
    d = decisions(role, PPO, None, {quantity: base * mask}, targets, mask)
    finite = torch.isfinite(d.margin_BT)
    assert bool(finite.any())
    for frac in (-0.999, -0.5, 0.5, 0.999):
        moved = base + frac * torch.where(finite, d.margin_BT, 0.0)
        e = decisions(role, PPO, None, {quantity: moved * mask}, targets, mask)
        assert torch.equal(e.clipped_BT, d.clipped_BT), frac
    # and moving every deciding quantity past its margin changes some decisions
    pushed = base + 1.5 * torch.where(finite, d.margin_BT, 0.0) * torch.sign(base - (old if role == "critic" else 1))
    assert differing(decisions(role, PPO, None, {quantity: pushed * mask}, targets, mask), d)


def test_imposing_the_natural_decisions_changes_nothing_and_other_decisions_change_loss_and_gradient():
    mask, old, values, returns, *_ = _data(3)
    v = values.clone().requires_grad_(True)
    loss, frac = clipped_value_loss(v, old, returns, mask, 0.2, "global")
    (grad,) = torch.autograd.grad(loss, v)
    natural = decisions("critic", PPO, None, {"values_BT": values * mask}, {"old_values_BT": old, "returns_BT": returns},
                        mask).clipped_BT
    loss2, frac2 = clipped_value_loss(v, old, returns, mask, 0.2, "global", decided_BT=natural)
    (grad2,) = torch.autograd.grad(loss2, v)
    assert torch.equal(loss, loss2) and torch.equal(frac, frac2) and torch.equal(grad, grad2)
    flipped = natural.clone()
    b, t = natural.nonzero()[0].tolist()
    flipped[b, t] = False  # take the unclipped term of one clipped token: its gradient comes back
    loss3, frac3 = clipped_value_loss(v, old, returns, mask, 0.2, "global", decided_BT=flipped)
    (grad3,) = torch.autograd.grad(loss3, v)
    assert grad[b, t] == 0 and grad3[b, t] != 0 and float(frac3) < float(frac)
    changed = (grad3 != grad).nonzero().tolist()
    assert changed == [[b, t]] and float(loss3.detach()) < float(loss.detach())


def _matrix():
    m = load_matrix("matrices/tiny-qwen3.yaml")
    return dataclasses.replace(m, reference=dataclasses.replace(m.reference, device="cpu"),
                               ppo=dataclasses.replace(m.ppo, epochs=3, value_clip_eps=0.02, clip_eps=0.02))


def _inputs(vocab: int, B: int = 4, T: int = 14):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, vocab - 1, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 6:] = True
    targets = {"old_logprobs_BT": -torch.rand(B, T, generator=g) * 5, "ref_logprobs_BT": -torch.rand(B, T, generator=g) * 5,
               "advantages_BT": torch.randn(B, T, generator=g), "returns_BT": torch.randn(B, T, generator=g),
               "old_values_BT": torch.zeros(B, T)}
    return {"input_ids_BT": ids, "response_mask_BT": mask}, targets


@pytest.mark.parametrize("role", ["critic", "actor"])
def test_the_reference_replayed_on_its_own_decisions_is_bitwise_itself_and_a_flip_moves_later_steps(tmp_path, role):
    matrix = _matrix()
    spec = matrix.models.tiny
    build_tiny_model(spec, role).save_pretrained(tmp_path)
    batch, targets = _inputs(spec.vocab_size)
    if role == "critic":  # old values at the step-0 values, so the 0.02 value clip decides tokens from step 1 on
        with torch.no_grad():
            targets["old_values_BT"] = hf.critic_values(hf.load_model(tmp_path, role), batch["input_ids_BT"]) + 0.0

    def run(decided=None):
        with torch.enable_grad():
            return run_role(ScoringContext.of(matrix, RunLayout(tmp_path), "sha256:r", "sha256:t"), role, "fp32", Control(name="r0"), hf.load_model(tmp_path, role), batch, targets,
                            spec.vocab_size, tmp_path, decided=decided)["steps"]

    mask = batch["response_mask_BT"]
    natural = run()
    quantity = "values_BT" if role == "critic" else "ratio_BT"
    own = [decisions(role, matrix.ppo, None, s["outputs"], targets, mask) for s in natural]
    assert any(int(d.clipped_BT.sum()) for d in own), "no clip decided: the test would not exercise anything"
    replay = run([d.clipped_BT for d in own])
    for a, b in zip(natural, replay):
        for group in ("outputs", "grads", "updates", "moments"):
            for name in a[group]:
                assert torch.equal(a[group][name], b[group][name]), (group, name)
    # one token decided otherwise at the last step with a clip: that step's gradient moves, earlier steps do not
    k = max(i for i, d in enumerate(own) if int(d.clipped_BT.sum()))
    flipped = [d.clipped_BT.clone() for d in own]
    r, t = own[k].clipped_BT.nonzero()[0].tolist()
    flipped[k][r, t] = False
    other = run(flipped)
    for i in range(k):
        assert torch.equal(other[i]["grads"][next(iter(other[i]["grads"]))], natural[i]["grads"][next(iter(natural[i]["grads"]))])
    assert any(not torch.equal(other[k]["grads"][n], natural[k]["grads"][n]) for n in natural[k]["grads"])
    assert torch.equal(other[k]["outputs"][quantity], natural[k]["outputs"][quantity])  # decided after the forward


def _dec(clipped, margin):
    return SimpleNamespace(clipped_BT=torch.tensor(clipped), margin_BT=torch.tensor(margin), quantity="values_BT",
                           name="value_clip")


def test_decision_rows_pass_flips_within_the_bound_and_fail_naming_the_others():
    bounds = {"step0/outputs/values_BT": {"max_abs": {"bound": 0.01}},
              "step1/outputs/values_BT": {"max_abs": {"bound": 0.01}}}
    ref = [_dec([[False, False, True]], [[0.5, 0.5, 0.5]]), _dec([[False, True, False]], [[0.005, 0.02, 0.01]])]
    cand = [_dec([[False, False, True]], [[0.5, 0.5, 0.5]]), _dec([[True, False, True]], [[0.0, 0.0, 0.0]])]
    rows = decision_rows("c", "critic", "vs ref", cand, ref, bounds)
    assert [r.tensor for r in rows] == ["step0/decisions/value_clip", "step1/decisions/value_clip"]
    assert rows[0].passed and rows[0].value == 0 and rows[0].note == ""
    bad = rows[1]
    assert not bad.passed and bad.value == 1 and bad.bound == 0 and bad.step == 1
    # token 0 at 0.005 and token 2 at exactly the bound are legitimate; token 1 at 0.02 is not, and is named
    assert "1 decided otherwise with the edge beyond the values_BT bound 0.01: row 0 token 1 at 0.02" in bad.note
    assert "2 within the bound of the edge (legitimate): row 0 token 0 at 0.005, row 0 token 2 at 0.01" in bad.note
    assert decision_rows("c", "critic", "vs ref", cand, ref, bounds, steps=1) == rows[:1]


@pytest.mark.parametrize("normalizer,constant", [("global", None), ("per_sequence", None), ("constant", 64.0)])
def test_loss_terms_sum_to_the_ppo_losses_for_every_normalizer(normalizer, constant):
    from qualify.ppo.decisions import loss_terms

    mask, old, values, returns, ratio, adv = _data(4)
    mask[2] = False  # a row without response
    ppo = SimpleNamespace(clip_eps=0.2, value_clip_eps=0.2, token_normalizer=normalizer, normalizer_constant=constant)
    critic, _ = clipped_value_loss(values.double(), old.double(), returns.double(), mask, 0.2, normalizer, constant)
    terms = loss_terms("critic", ppo, None, {"values_BT": values * mask}, {"old_values_BT": old, "returns_BT": returns},
                       mask)
    assert float(terms.sum()) == pytest.approx(float(critic), rel=1e-12) and not bool(terms[~mask].any())
    actor, _, _ = clipped_policy_loss(torch.log(ratio).double(), torch.zeros_like(ratio).double(), adv.double(),
                                             mask, 0.2, normalizer, constant)
    terms = loss_terms("actor", ppo, None, {"ratio_BT": ratio * mask}, {"advantages_BT": adv}, mask)
    assert float(terms.sum()) == pytest.approx(float(actor), rel=1e-6)


@pytest.mark.parametrize("aggregation,constant", [("token_mean", None), ("seq_mean_token_mean", None),
                                                  ("seq_mean_token_sum_norm", 40.0)])
def test_loss_terms_sum_to_the_grpo_loss_for_every_aggregation(aggregation, constant):
    from qualify.ppo.decisions import loss_terms
    from qualify.ppo.grpo import kl_estimate

    mask, _, _, _, ratio, _ = _data(5)
    logp, ref = torch.log(ratio).double(), -torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)).double()
    adv_B = torch.randn(mask.shape[0]).double()
    grpo = SimpleNamespace(kl_coef=0.04, aggregation=aggregation, constant=constant)
    out = grpo_loss(logp, torch.zeros_like(logp), ref, token_advantages(adv_B, mask), mask, clip_eps=0.2,
                    kl_coef=0.04, kl_estimator="k3", aggregation=aggregation, normalizers=count_normalizers(mask),
                    constant=constant)
    outputs = {"ratio_BT": out.ratio_BT * mask, "advantages_B": adv_B, "kl_BT": kl_estimate(logp, ref, mask, "k3")}
    terms = loss_terms("actor", PPO, grpo, outputs, {}, mask)
    assert float(terms.sum()) == pytest.approx(float(out.loss), rel=1e-12)


def test_freeze_takes_the_sum_of_per_token_loss_differences_as_the_loss_control_error():
    """Two controls whose loss differences nearly cancel: the loss's control error is the larger sum of |per-token
    contribution differences| (an obvious loop), not the tiny |loss difference|; without terms it is the latter."""
    from qualify.bounds.control_error import LOSS_TERMS_TEXT, step_family_bounds
    from qualify.bounds.rule import BoundRule
    from qualify.compare import RunTensors
    from qualify.ppo.decisions import loss_terms

    mask, old, values, returns, *_ = _data(6, B=3, T=8)
    ppo = SimpleNamespace(clip_eps=0.2, value_clip_eps=0.2, token_normalizer="global", normalizer_constant=None)
    targets = {"old_values_BT": old, "returns_BT": returns}

    def run(v):
        loss, _ = clipped_value_loss(v, old, returns, mask, 0.2, "global")
        return RunTensors({"values_BT": v * mask, "loss": loss.reshape(())}, {}, {}, {})

    g = torch.Generator().manual_seed(9)
    base = run(values)
    controls = {f"c{i}": run(values + 1e-3 * torch.randn(values.shape, generator=g)) for i in range(2)}
    rule = BoundRule(4.0, {"value": 0.0, "loss": 0.0, "logprob": 0.0}, 0.0, "fp32", False)
    terms = lambda r: loss_terms("critic", ppo, None, r.outputs, targets, mask)
    with_terms = step_family_bounds(base, controls, rule, {"base": {}, "c0": {}, "c1": {}}, "base", OPT_, 1, terms)
    plain = step_family_bounds(base, controls, rule, {"base": {}, "c0": {}, "c1": {}}, "base", OPT_, 1)
    n = float(mask.sum())
    expect = 0.0
    for c in controls.values():
        total = 0.0
        for b in range(mask.shape[0]):
            for t in range(mask.shape[1]):
                if mask[b, t]:
                    def term(v, o=float(old[b, t]), r=float(returns[b, t])):
                        vc = o + min(max(v - o, -0.2), 0.2)
                        return 0.5 * max((v - r) ** 2, (vc - r) ** 2) / n
                    total += abs(term(float(c.outputs["values_BT"][b, t])) - term(float(values[b, t])))
        expect = max(expect, total)
    loss = with_terms["outputs/loss"]["max_abs"]
    assert loss["control_error"] == pytest.approx(expect, rel=1e-9) and loss["control_error_of"] == LOSS_TERMS_TEXT
    plain_error = max(abs(float(c.outputs["loss"]) - float(base.outputs["loss"])) for c in controls.values())
    assert plain["outputs/loss"]["max_abs"]["control_error"] == pytest.approx(plain_error)
    assert loss["control_error"] > 2 * plain_error and "control_error_of" not in plain["outputs/loss"]["max_abs"]
    assert with_terms["outputs/values_BT"] == plain["outputs/values_BT"]  # nothing else changes


OPT_ = SimpleNamespace(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def test_a_token_decided_clipped_inside_the_range_takes_the_edge_term_and_no_gradient():
    """The candidate's value crossed the edge (0.21: clipped, no gradient), the replayed reference's sits just inside
    (0.19): imposing the decision gives the reference's token the candidate's term at the edge and no gradient."""
    old, ret, mask = torch.zeros(1, 3), torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3, dtype=torch.bool)
    v = torch.tensor([[0.19, -0.19, 0.05]], dtype=torch.float64, requires_grad=True)
    decided = torch.tensor([[True, False, False]])
    loss, frac = clipped_value_loss(v, old.double(), ret.double(), mask, 0.2, "global", decided_BT=decided)
    (grad,) = torch.autograd.grad(loss, v)
    assert float(loss) == pytest.approx(0.5 * ((0.2 - 1) ** 2 + (-0.19 - 1) ** 2 + (0.05 + 1) ** 2) / 3, rel=1e-12)
    assert grad[0, 0] == 0 and grad[0, 1] == pytest.approx((-0.19 - 1) / 3) and grad[0, 2] == pytest.approx(1.05 / 3)
    assert float(frac) == pytest.approx(1 / 3)
    candidate = torch.tensor([[0.21, -0.19, 0.05]], dtype=torch.float64, requires_grad=True)
    c_loss, _ = clipped_value_loss(candidate, old.double(), ret.double(), mask, 0.2, "global")
    (c_grad,) = torch.autograd.grad(c_loss, candidate)
    assert c_grad[0, 0] == 0 and float(c_loss) == pytest.approx(float(loss), rel=1e-12)  # the same term, the same loss
    # the surrogate: A > 0 and a ratio just inside 1.2 decided clipped: -A x 1.2, no gradient
    logp = torch.log(torch.tensor([[1.19, 1.0]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[2.0, 1.0]], dtype=torch.float64)
    p_loss, _, p_frac = clipped_policy_loss(logp, torch.zeros(1, 2, dtype=torch.float64), adv, mask[:, :2], 0.2,
                                            "global", decided_BT=torch.tensor([[True, False]]))
    (p_grad,) = torch.autograd.grad(p_loss, logp)
    assert float(p_loss) == pytest.approx((-2.0 * 1.2 - 1.0) / 2) and p_grad[0, 0] == 0 and p_grad[0, 1] != 0
    assert float(p_frac) == 0.5


def test_freeze_takes_the_norm_of_the_gradient_difference_as_the_grad_norm_control_error():
    """Two controls whose gradients differ but whose norms nearly agree: the grad norm's control error is the largest
    norm of a whole-gradient difference (an obvious loop over every element), which bounds |norm difference|."""
    import math

    from qualify.bounds.control_error import NORM_TEXT, step_family_bounds
    from qualify.bounds.rule import BoundRule
    from qualify.compare import RunTensors

    g = torch.Generator().manual_seed(2)
    base_grads = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}

    def run(grads):
        norm = torch.sqrt(sum(x.double().square().sum() for x in grads.values())).float()
        return RunTensors({"grad_norm": norm}, grads, {}, {})

    rotated = {"w": base_grads["w"].flip(0), "b": base_grads["b"].flip(0)}  # the same norm, another gradient
    scaled = {n: x * 1.001 for n, x in base_grads.items()}
    base, controls = run(base_grads), {"rot": run(rotated), "scaled": run(scaled)}
    rule = BoundRule(4.0, {"grad_norm": 0.0, "grad": 0.0, "relative": 0.0}, 0.0, "fp32", False)
    bounds = step_family_bounds(base, controls, rule, {"base": {}, "rot": {}, "scaled": {}}, "base", OPT_, 1)
    entry = bounds["outputs/grad_norm"]["max_abs"]
    expect = 0.0
    for c in (rotated, scaled):
        total = 0.0
        for n, ref in base_grads.items():
            for x, y in zip(c[n].flatten().tolist(), ref.flatten().tolist()):
                total += (x - y) ** 2
        expect = max(expect, math.sqrt(total))
    assert entry["control_error"] == pytest.approx(expect, rel=1e-9) and entry["control_error_of"] == NORM_TEXT
    assert expect > 100 * abs(float(controls["scaled"].outputs["grad_norm"] - base.outputs["grad_norm"]))
