"""The peers' policy-loss settings of the ppo section: asymmetric clip edges (verl clip_ratio_low/high, TRL
epsilon_high), verl's dual clip (clip_ratio_c) and the entropy bonus (entropy_coeff). The losses and their gradients
against slow, obvious loops over tokens; the clip decisions at each edge; imposed decisions; the per-token loss terms
and clip fraction the judge derives; the sampler entropy and its derivation; the coverage branch; the matrix's fields."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qualify.acceptance import frozen_field_differences, read_snapshot
from qualify.engines.base import OutputScoring
from qualify.judge.derived import clip_frac_derivation, entropy_check
from qualify.matrix import PPO, load_matrix
from qualify.ppo.coverage import step_coverage
from qualify.ppo.decisions import decisions, loss_terms
from qualify.ppo.entropy import naive_sampler_entropy, sampler_entropy
from qualify.ppo.grpo import count_normalizers, grpo_loss, token_advantages
from qualify.ppo.math import clipped_policy_loss, policy_settings
from qualify.ppo.objective import role_objective
from qualify.schema import to_dict
from qualify.store import write_json
from tests.unit.matrix.test_loader import edited, load_error, setter, write

PEER = PPO(clip_eps=0.2, clip_eps_low=0.15, clip_eps_high=0.28, dual_clip_c=1.3, entropy_coef=0.01)
"""Every new setting at once; c = 1.3 so that random ratios reach it."""
CONSTANT = 11.0


def _data(seed: int = 0, B: int = 6, T: int = 30):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[1] = False  # a row without response
    logp = 0.35 * torch.randn(B, T, generator=g).double()  # ratios exp(logp) on both sides of every edge
    adv = torch.randn(B, T, generator=g).double()
    entropy = torch.rand(B, T, generator=g).double() * 3
    return mask, logp, adv, entropy


def _loop_term(r: float, a: float, low: float, high: float, c: float | None) -> tuple[float, bool]:
    """(the token's clipped surrogate, whether a clipped term is taken), written from the formulas."""
    plain, edged = -a * r, -a * min(max(r, 1 - low), 1 + high)
    term, clipped = max(plain, edged), edged > plain
    if c is not None and a < 0:
        clipped = clipped or term > -a * c
        term = min(term, -a * c)
    return term, clipped


def _loop_weights(mask: torch.Tensor, normalizer: str) -> list[list[float]]:
    """Each token's weight in the masked mean, by counting."""
    B, T = mask.shape
    total = sum(int(mask[b, t]) for b in range(B) for t in range(T))
    rows = [sum(int(mask[b, t]) for t in range(T)) for b in range(B)]
    live = sum(1 for n in rows if n)
    out = []
    for b in range(B):
        out.append([0.0 if not mask[b, t] else 1 / total if normalizer == "global" else 1 / CONSTANT
                    if normalizer == "constant" else 1 / (rows[b] * live) for t in range(T)])
    return out


@pytest.mark.parametrize("normalizer", ["global", "per_sequence", "constant"])
@pytest.mark.parametrize("ppo", [PEER, dataclasses.replace(PEER, dual_clip_c=None, entropy_coef=0.0),
                                 dataclasses.replace(PEER, clip_eps_low=None, clip_eps_high=None)],
                         ids=["all", "asymmetric-only", "dual-and-entropy"])
def test_the_policy_loss_and_its_gradient_match_a_loop(ppo, normalizer):
    mask, logp, adv, entropy = _data(1)
    s = policy_settings(ppo)
    lp, h = logp.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    constant = CONSTANT if normalizer == "constant" else None
    loss, _, clip_frac = clipped_policy_loss(lp, torch.zeros_like(logp), adv, mask, s.low, normalizer, constant,
                                             clip_eps_high=s.high, dual_clip_c=s.dual_c, entropy_BT=h,
                                             entropy_coef=s.entropy_coef)
    grad_logp, grad_h = torch.autograd.grad(loss, (lp, h), allow_unused=True)
    grad_h = torch.zeros_like(h) if grad_h is None else grad_h  # no bonus: the entropy is not read
    weights = _loop_weights(mask, normalizer)
    want_loss = want_frac = 0.0
    seen_dual = seen_high = 0
    for b, t in mask.nonzero().tolist():
        r, a, w = math.exp(float(logp[b, t])), float(adv[b, t]), weights[b][t]
        term, clipped = _loop_term(r, a, s.low, s.high, s.dual_c)
        want_loss += w * (term - s.entropy_coef * float(entropy[b, t]))
        want_frac += w * clipped
        # d loss / d logp: the unclipped term's -A r where it is taken, 0 where a clipped (constant) term is
        assert float(grad_logp[b, t]) == pytest.approx(0.0 if clipped else -a * r * w, abs=1e-15)
        assert float(grad_h[b, t]) == pytest.approx(-s.entropy_coef * w, abs=1e-15)
        seen_dual += s.dual_c is not None and a < 0 and r > s.dual_c
        seen_high += a > 0 and 1 + ppo.clip_eps < r <= 1 + s.high  # clipped symmetrically, not here
    assert float(loss) == pytest.approx(want_loss, rel=1e-12)
    assert float(clip_frac) == pytest.approx(want_frac, rel=1e-12)
    assert not bool(grad_logp[~mask].any()) and not bool(grad_h[~mask].any())
    assert seen_dual or s.dual_c is None
    assert seen_high or s.high == ppo.clip_eps  # the data has tokens between the symmetric and the asymmetric edge


def test_defaults_are_the_symmetric_clip_bitwise():
    mask, logp, adv, entropy = _data(2)
    assert policy_settings(PPO()) == (0.2, 0.2, None, 0.0)
    assert policy_settings(SimpleNamespace(clip_eps=0.3)) == (0.3, 0.3, None, 0.0)  # an object that predates them
    plain = clipped_policy_loss(logp, torch.zeros_like(logp), adv, mask, 0.2, "global")
    spelled = clipped_policy_loss(logp, torch.zeros_like(logp), adv, mask, 0.2, "global", clip_eps_high=0.2,
                                  dual_clip_c=None, entropy_BT=entropy, entropy_coef=0.0)
    assert all(torch.equal(x, y) for x, y in zip(plain, spelled, strict=True))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_grpo_loss_with_peer_settings_matches_a_loop(aggregation):
    mask, logp, _, entropy = _data(3)
    adv_B = torch.randn(mask.shape[0], generator=torch.Generator().manual_seed(4)).double()
    ref = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(5)).double()
    s = policy_settings(PEER)
    h = entropy.clone().requires_grad_(True)
    out = grpo_loss(logp, torch.zeros_like(logp), ref, token_advantages(adv_B, mask), mask, clip_eps=s.low,
                    clip_eps_high=s.high, dual_clip_c=s.dual_c, kl_coef=0.04, kl_estimator="k1",
                    aggregation=aggregation, normalizers=count_normalizers(mask), entropy_BT=h,
                    entropy_coef=s.entropy_coef)
    (grad_h,) = torch.autograd.grad(out.loss, h)
    weights = _loop_weights(mask, "global" if aggregation == "token_mean" else "per_sequence")
    want = want_pg = 0.0
    for b, t in mask.nonzero().tolist():
        term, _ = _loop_term(math.exp(float(logp[b, t])), float(adv_B[b]), s.low, s.high, s.dual_c)
        w = weights[b][t]
        want += w * (term + 0.04 * (float(logp[b, t]) - float(ref[b, t])) - s.entropy_coef * float(entropy[b, t]))
        want_pg += w * term
        assert float(grad_h[b, t]) == pytest.approx(-s.entropy_coef * w, abs=1e-15)
    assert float(out.loss) == pytest.approx(want, rel=1e-12)
    assert float(out.policy_loss) == pytest.approx(want_pg, rel=1e-12)  # the surrogate alone, without the bonus


def test_the_objective_reports_the_entropy_with_a_bonus_and_refuses_a_bonus_without_it():
    mask, logp, adv, entropy = _data(6)
    targets = {"old_logprobs_BT": torch.zeros_like(logp), "advantages_BT": adv, "ref_logprobs_BT": logp * 0.5}
    _, plain = role_objective("actor", PPO(), logp, mask, targets)
    assert "entropy_BT" not in plain
    _, out = role_objective("actor", PEER, logp, mask, targets, entropy_BT=entropy)
    assert torch.equal(out["entropy_BT"], torch.where(mask, entropy, 0.0))
    with pytest.raises(ValueError, match="an entropy coefficient of 0.01 needs the policy's entropy"):
        role_objective("actor", PEER, logp, mask, targets)


def test_decisions_take_each_edge_on_its_own_and_agree_with_the_objective():
    mask, logp, adv, _ = _data(7)
    s = policy_settings(PEER)
    ratio = torch.exp(torch.where(mask, logp, 0.0)).float()
    d = decisions("actor", PEER, None, {"ratio_BT": ratio * mask}, {"advantages_BT": adv.float()}, mask)
    for b, t in mask.nonzero().tolist():
        r, a = float(ratio[b, t]), float(adv[b, t])
        _, clipped = _loop_term(r, a, s.low, s.high, s.dual_c)
        assert bool(d.clipped_BT[b, t]) == clipped, (b, t, r, a)
        edges = [1 + s.high] if a > 0 else [1 - s.low, s.dual_c]
        assert float(d.margin_BT[b, t]) == pytest.approx(min(abs(r - e) for e in edges), abs=1e-6)
    _, _, clip_frac = clipped_policy_loss(logp.float(), torch.zeros_like(logp).float(), adv.float(), mask, s.low,
                                          "global", clip_eps_high=s.high, dual_clip_c=s.dual_c)
    assert float(d.clipped_BT.float().sum() / mask.sum()) == pytest.approx(float(clip_frac), abs=1e-7)
    # a decision never changes within its margin, and the dual clip's edge is one of them
    for frac in (-0.999, 0.999):
        moved = ratio + frac * torch.where(torch.isfinite(d.margin_BT), d.margin_BT, 0.0)
        e = decisions("actor", PEER, None, {"ratio_BT": moved * mask}, {"advantages_BT": adv.float()}, mask)
        assert torch.equal(e.clipped_BT, d.clipped_BT), frac
    dual = (adv < 0) & (ratio > s.dual_c) & mask
    assert int(dual.sum()) > 0 and bool(d.clipped_BT[dual].all())
    assert not decisions("actor", dataclasses.replace(PEER, dual_clip_c=None), None, {"ratio_BT": ratio * mask},
                         {"advantages_BT": adv.float()}, mask).clipped_BT[dual].any()  # only the dual clip clips them


def test_imposed_decisions_reproduce_the_run_and_take_the_dual_edge():
    mask, logp, adv, _ = _data(8)
    s = policy_settings(PEER)
    lp = logp.clone().requires_grad_(True)

    def run(decided=None):
        loss, _, frac = clipped_policy_loss(lp, torch.zeros_like(logp), adv, mask, s.low, "global", None, decided,
                                            clip_eps_high=s.high, dual_clip_c=s.dual_c)
        return loss, frac, torch.autograd.grad(loss, lp)[0]

    loss, frac, grad = run()
    ratio = torch.exp(torch.where(mask, logp, 0.0))
    natural = decisions("actor", PEER, None, {"ratio_BT": ratio * mask}, {"advantages_BT": adv}, mask).clipped_BT
    loss2, frac2, grad2 = run(natural)
    assert torch.equal(loss, loss2) and torch.equal(frac, frac2) and torch.equal(grad, grad2)
    # a negative-advantage token just inside c, decided clipped (another run's ratio crossed c): the dual edge's
    # constant -A c, no gradient; the rest unchanged
    inside = (adv < 0) & (ratio < s.dual_c) & (ratio > (1 - s.low + s.dual_c) / 2) & mask
    b, t = inside.nonzero()[0].tolist()
    forced = natural.clone()
    forced[b, t] = True
    loss3, _, grad3 = run(forced)
    assert grad3[b, t] == 0 and grad[b, t] != 0
    assert (grad3 != grad).nonzero().tolist() == [[b, t]]
    shift = (-float(adv[b, t]) * s.dual_c - (-float(adv[b, t]) * float(ratio[b, t]))) / int(mask.sum())
    assert float(loss3 - loss) == pytest.approx(shift, rel=1e-9)


def test_loss_terms_and_the_clip_fraction_derive_from_the_outputs_with_peer_settings():
    mask, logp, adv, entropy = _data(9)
    s = policy_settings(PEER)
    ppo = dataclasses.replace(PEER, token_normalizer="per_sequence")
    loss, ratio, clip_frac = clipped_policy_loss(logp, torch.zeros_like(logp), adv, mask, s.low, "per_sequence",
                                                 clip_eps_high=s.high, dual_clip_c=s.dual_c, entropy_BT=entropy,
                                                 entropy_coef=s.entropy_coef)
    outputs = {"ratio_BT": ratio * mask, "entropy_BT": entropy * mask}
    terms = loss_terms("actor", ppo, None, outputs, {"advantages_BT": adv}, mask)
    assert float(terms.sum()) == pytest.approx(float(loss), rel=1e-12)
    assert loss_terms("actor", ppo, None, {"ratio_BT": ratio * mask}, {"advantages_BT": adv}, mask) is None
    derived, _ = clip_frac_derivation((ratio * mask).float(), adv.float(), mask,
                                      SimpleNamespace(ppo=ppo, grpo=None))
    assert float(derived) == pytest.approx(float(clip_frac), abs=1e-7)
    symmetric, _ = clip_frac_derivation((ratio * mask).float(), adv.float(), mask,
                                        SimpleNamespace(ppo=PPO(token_normalizer="per_sequence"), grpo=None))
    assert abs(float(symmetric) - float(clip_frac)) > 0.01  # the settings move it


def test_the_dual_clip_is_a_branch_the_coverage_counts():
    mask, logp, adv, _ = _data(10)
    ratio = torch.exp(torch.where(mask, logp, 0.0))
    outputs = {"ratio_BT": ratio * mask, "kl_BT": logp * mask}
    cov = step_coverage("actor", PEER, 1.0, outputs, {"advantages_BT": adv}, mask, 0.5, 1)
    assert cov["policy_clip_dual"] == int(((ratio > 1.3) & (adv < 0) & mask).sum()) > 0
    assert cov["policy_clip_high"] == int(((ratio > 1.28) & mask).sum())
    assert cov["policy_clip_low"] == int(((ratio < 0.85) & mask).sum())
    assert "policy_clip_dual" not in step_coverage("actor", PPO(), 1.0, outputs, {"advantages_BT": adv}, mask, 0.5, 1)


def _logits(seed: int, B: int = 3, T: int = 7, V: int = 40) -> torch.Tensor:
    return 3 * torch.randn(B, T, V, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_sampler_entropy_is_the_entropy_of_the_tempered_distribution_with_its_gradient(chunk):
    logits = _logits(11).double()
    vocab = 37  # three padding columns
    got = sampler_entropy(logits, 0.7, chunk, vocab)
    temperature = float(torch.tensor(0.7, dtype=torch.float32))  # as vLLM holds it (qualify.ppo.logprob)
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            z = [float(x) / temperature for x in logits[b, t, :vocab]]
            m = max(z)
            total = sum(math.exp(x - m) for x in z)
            want = -sum(math.exp(x - m) / total * (x - m - math.log(total)) for x in z)
            assert float(got[b, t]) == pytest.approx(want, rel=1e-12)
    x = logits.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((sampler_entropy(x, 0.7, chunk, vocab) * torch.arange(21.0).view(3, 7)).sum(), x)
    y = logits.clone().requires_grad_(True)
    (want_grad,) = torch.autograd.grad((naive_sampler_entropy(y, 0.7, vocab) * torch.arange(21.0).view(3, 7)).sum(), y)
    assert torch.allclose(grad, want_grad, rtol=1e-10, atol=1e-12) and not bool(grad[..., vocab:].any())
    assert torch.autograd.gradcheck(lambda v: sampler_entropy(v, 0.7, chunk, vocab), (logits[:1, :2].clone()
                                                                                      .requires_grad_(True),))


def test_entropy_derivation_passes_the_engines_formula_and_fails_another_temperature():
    logits = _logits(12, B=4, T=9, V=512)
    mask = torch.zeros(4, 9, dtype=torch.bool)
    mask[:, 4:] = True
    own = torch.nn.functional.pad(sampler_entropy(logits[:, :-1], 0.8, 8, 500), (1, 0))
    good = entropy_check(logits, own, mask, 0.8, 500)
    assert good["row"] is not None and good["value"] <= 0.25 * good["bound"], good
    wrong = torch.nn.functional.pad(sampler_entropy(logits[:, :-1], 1.0, 8, 500), (1, 0))
    bad = entropy_check(logits, wrong, mask, 0.8, 500)
    assert bad["value"] > 1000 * bad["bound"], bad
    shifted = entropy_check(logits, torch.nn.functional.pad(own[:, :-1], (1, 0)), mask, 0.8, 500)  # one position off
    assert shifted["value"] > 1000 * shifted["bound"], shifted


class _Scorer(OutputScoring):
    """OutputScoring on a linear LM head: logits = h W, so the entropy's gradient can be checked on W."""

    def __init__(self, role: str, vocab: int = 20):
        self.ctx = SimpleNamespace(role=role, logprob_formula="full", temperature=0.8, logprob_chunk_tokens=3,
                                   vocab_size=vocab)
        g = torch.Generator().manual_seed(13)
        self.weight = torch.randn(8, vocab, generator=g, dtype=torch.float64).requires_grad_(True)
        self.hidden = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)

    def score(self, ids_BT: torch.Tensor) -> torch.Tensor:
        return self.scores_from(self.hidden @ self.weight, ids_BT)


def test_the_entropy_hook_trains_through_the_scoring_forward():
    engine = _Scorer("actor")
    ids = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(15))
    engine.score(ids)
    entropy = engine.entropy()
    assert entropy is engine.entropy() and entropy.requires_grad  # one answer per score(), in the graph
    (grad,) = torch.autograd.grad(entropy.sum(), engine.weight)
    want_logits = (engine.hidden @ engine.weight)[:, :-1]
    (want,) = torch.autograd.grad(naive_sampler_entropy(want_logits, 0.8).sum(), engine.weight)
    assert torch.allclose(grad, want, rtol=1e-10, atol=1e-12) and bool(grad.abs().sum() > 0)
    assert torch.equal(entropy[:, 0], torch.zeros(2, dtype=torch.float64))  # position 0 is scored by nothing
    critic = _Scorer("critic")
    critic.score(ids)
    assert critic.entropy() is None


def test_the_matrix_takes_the_fields_and_a_snapshot_without_them_reads_as_their_defaults(tmp_path):
    data = edited(setter("ppo.clip_eps_high", 0.28))
    data["ppo"].update(clip_eps_low=0.2, dual_clip_c=3.0, entropy_coef=0.001)
    data["freeze"]["require"] = [*data["freeze"]["require"], "policy_clip_dual"]
    m = load_matrix(write(tmp_path, data))
    assert policy_settings(m.ppo) == (0.2, 0.28, 3.0, 0.001)
    data["candidates"]["vocab_tile"] = 64
    assert "ppo.entropy_coef 0.001 with candidates.vocab_tile 64: the vocab-parallel logprob path computes no " \
           "entropy" in load_error(tmp_path, data)
    # a reference sealed before these fields existed reads as their defaults: the unchanged matrix still matches
    tiny = load_matrix("matrices/tiny-qwen3.yaml")
    old = to_dict(tiny)
    for key in ("clip_eps_low", "clip_eps_high", "dual_clip_c", "entropy_coef"):
        del old["ppo"][key]
    write_json(tmp_path / "matrix.json", old)
    assert frozen_field_differences(read_snapshot(tmp_path / "matrix.json"), to_dict(tiny)) == []
    changed = dataclasses.replace(tiny, ppo=dataclasses.replace(tiny.ppo, dual_clip_c=3.0))
    assert frozen_field_differences(read_snapshot(tmp_path / "matrix.json"), to_dict(changed)) == [
        "ppo.dual_clip_c: None (frozen) != 3.0"]
    committed = read_snapshot(Path("manifests/tiny-qwen3/reference/matrix/matrix.json"))
    assert frozen_field_differences(committed, to_dict(tiny)) == []



def test_fingerprints_and_specs_leave_out_the_settings_at_their_defaults(tmp_path):
    """An unchanged matrix's scoring fingerprint and case specs (resume keys) read as before the fields existed; a
    matrix that sets one carries it, and its spec reads back equal."""
    from qualify.case.spec import make_spec, read_spec
    from qualify.reference.evidence import scoring_settings
    from qualify.stages import fingerprint

    tiny = load_matrix("matrices/tiny-qwen3.yaml")
    m = to_dict(tiny)
    before = {"rollout": "sha256:r", **{k: m[k] for k in ("models", "ppo", "optimizer", "reference")}}
    for key in ("clip_eps_low", "clip_eps_high", "dual_clip_c", "entropy_coef"):
        del before["ppo"][key]
    before["reference"] = {k: v for k, v in m["reference"].items() if k not in ("evidence", "layer_activations")}
    assert scoring_settings(tiny, "sha256:r") == fingerprint(before)
    peer = dataclasses.replace(tiny, ppo=dataclasses.replace(tiny.ppo, dual_clip_c=3.0))
    assert scoring_settings(peer, "sha256:r") != fingerprint(before)
    kw = {k: tmp_path for k in ("model_dir", "rollout_dir", "targets_dir", "case_dir")}
    for matrix, keys in ((tiny, set()), (peer, {"dual_clip_c"})):
        spec = make_spec(matrix.case_settings, matrix.cases()[0], rollout_digest="r", targets_digest="t",
                         vocab_size=512, device="cpu", **kw)
        assert set(spec.to_json()["ppo"]) & {"clip_eps_low", "clip_eps_high", "dual_clip_c", "entropy_coef"} == keys
        write_json(tmp_path / "spec.json", spec.to_json())
        assert read_spec(tmp_path / "spec.json") == spec
