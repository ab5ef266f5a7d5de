"""PPO at DP2 on the embedded default (the committed rollout, actor and critic): torch-tp and deepspeed pass against
the reference and against their DP1 cases, every tensor with its invariance tier; a loss that is the mean of the
ranks' token means and gradients divided by DP twice each fail naming their tensors from step 0, by 10x their
bounds or more; a PPO objective() that cannot take the step's share is refused at DP2; `qualify diagnose` runs a DP2
case on its tp x dp ranks."""

from __future__ import annotations

import shutil

import pytest

from qualify.candidate.stage import run_candidates
from qualify.layout import RunLayout
from qualify.ppo.grpo import dp_slices
from qualify.rollout.capture import load_rollout
from tests.integration._support import matrix_with, plugins_importable, require_module  # noqa: F401  (autouse)

pytestmark = [pytest.mark.engines]


@pytest.fixture(scope="module")
def ppo_dp_run(frozen_run, tmp_path_factory):
    """A private copy of the frozen embedded default (reference + acceptance) for this module's candidates."""
    dst = tmp_path_factory.mktemp("ppo-dp") / "run"
    shutil.copytree(frozen_run / "reference", dst / "reference")
    shutil.copytree(frozen_run / "acceptance", dst / "acceptance")
    return dst


def dp2_matrix(tmp_path, **candidates):
    settings = {"engines": ["torch-tp"], "precisions": ["fp32"], "tp": [1], "dp": [1, 2],
                "roles": ["actor", "critic"]} | candidates
    return matrix_with(tmp_path, **settings)


def ratio(row: dict) -> float:
    return float(row["value"]) / float(row["bound"]) if float(row["bound"]) > 0 else float("inf")


def closest(verdict: dict, case: str, frozen: bool = False) -> dict:
    """The case's row nearest its bound (value / bound), among rows with a bound above 0 (frozen: bounds of a family
    of controls, '... [<family>]', not the rounding bounds of derivations)."""
    rows = [r for r in verdict["rows"] if r["case"] == case and float(r["bound"] or 0) > 0
            and (not frozen or r["comparison"].endswith("]"))]
    return max(rows, key=ratio)


def said(row: dict) -> str:
    return f"{row['comparison']} {row['tensor']} {row['metric']} {float(row['value']):.3g} / " \
           f"{float(row['bound']):.3g} = {ratio(row):.3f}"


def test_the_rollout_gives_the_dp_ranks_unequal_tokens(ppo_dp_run):
    """The negative controls below need it: with equal active tokens per rank a mean of the ranks' token means is
    the step's token mean."""
    mask_BT = load_rollout(RunLayout(ppo_dp_run).rollout(1))["response_mask_BT"]
    counts = [int(mask_BT[rows].sum()) for rows in dp_slices(mask_BT.shape[0], 2)]
    assert counts[0] != counts[1], counts


@pytest.mark.parametrize("engine", ["torch-tp", pytest.param("deepspeed", marks=pytest.mark.extended)])
def test_torch_tp_and_deepspeed_pass_ppo_at_dp2(ppo_dp_run, tmp_path, engine):
    """torch-tp in the suite; deepspeed (whose DP the GRPO chain and the DP matrix run too) in the extended sweeps."""
    require_module("deepspeed")
    m = dp2_matrix(tmp_path, engines=[engine], precisions=["fp32", "bf16"])
    verdict = run_candidates(m, ppo_dp_run).to_json()
    cases = verdict["cases"]
    assert set(cases) == {c.name for c in m.cases()} and len(cases) == 8
    failed = [r for r in verdict["rows"] if not r["passed"]]
    assert verdict["passed"] and not failed, failed[:5]
    for case in (c.name for c in m.cases() if c.dp == 2):
        judged = {r["tensor"].split("/", 1)[1] for r in verdict["rows"] if r["case"] == case}
        role_outputs = {"outputs/logprobs_BT", "outputs/kl_mean"} if case.endswith("actor") else {"outputs/values_BT"}
        assert {"outputs/loss", "outputs/clip_frac", "outputs/grad_norm"} | role_outputs <= judged, case
        tiers = cases[case]["invariance"]["vs dp1"]
        assert tiers["counts"]["failing"] == 0 and sum(tiers["counts"].values()) > 0, case
        print(f"{case}: closest {said(closest(verdict, case))}; closest frozen bound "
              f"{said(closest(verdict, case, frozen=True))}; tiers {tiers['counts']}")


@pytest.mark.parametrize(("factory", "failing"), [
    ("mean_of_rank_means", {"outputs/loss"}),
    ("grads_divided_twice", {"outputs/grad_norm"}),
])
def test_ppo_dp_bugs_fail_naming_the_tensor(ppo_dp_run, tmp_path, factory, failing):
    """Negative controls at TP1xDP2, actor and critic: the loss as the mean of the ranks' token means (the ranks hold
    unequal tokens), and gradients divided by dp after the DP sum. At step 0 (the same weights as the reference) the
    bug's tensors fail by 10x their bounds or more, the gradients among them, and the forward's outputs pass."""
    m = dp2_matrix(tmp_path, engines=[f"tests.integration.ppo_dp_plugins:{factory}"], dp=[2])
    verdict = run_candidates(m, ppo_dp_run).to_json()
    assert not verdict["passed"]
    assert all(r["passed"] for r in verdict["rows"] if r["comparison"] == "evidence"), "no crash, no NaN"
    for case in (c.name for c in m.cases()):
        step0 = [r for r in verdict["rows"] if r["case"] == case and r["tensor"].startswith("step0/")]
        failed = {r["tensor"].removeprefix("step0/") for r in step0 if not r["passed"]}
        grads = [r for r in step0 if r["tensor"].startswith("step0/grads/") and not r["passed"]]
        assert failing <= failed and grads, sorted(failed)[:10]
        forward = "outputs/logprobs_BT" if case.endswith("actor") else "outputs/values_BT"
        assert forward not in failed
        named = {t: max(ratio(r) for r in step0 if r["tensor"] == f"step0/{t}" and not r["passed"]) for t in failing}
        worst_grad = max(grads, key=ratio)
        print(f"{case}: " + ", ".join(f"{t} {v:.3g}x" for t, v in named.items())
              + f", {worst_grad['tensor']} {worst_grad['metric']} {ratio(worst_grad):.3g}x")
        assert min(named.values()) >= 10 and ratio(worst_grad) >= 10


def test_diagnose_runs_a_dp2_case(ppo_dp_run, tmp_path):
    """`qualify diagnose` launches a DP2 case's tp x dp ranks, each DP rank forwarding its own rows, gathered in rank
    order: a correct engine's case stays within every layer bound."""
    from qualify.diagnose.stage import diagnose

    case = "torch-tp-fp32-tp1-dp2-actor"
    run_candidates(dp2_matrix(tmp_path, dp=[2], roles=["actor"]), ppo_dp_run, only=case)
    diagnosis = diagnose(ppo_dp_run, case)
    assert diagnosis["dp"] == 2 and diagnosis["layer_outputs_hook"]
    assert diagnosis["passed"] and diagnosis["first_departure"] is None, diagnosis["first_departure"]
    rows = diagnosis["families"]["fp32-repeat"]["rows"]
    assert {"act/model.layers.0", "act/model.layers.1", "grads/model.layers.0"} <= {r["key"] for r in rows}


def test_an_objective_without_share_is_refused_at_dp2_in_one_line(ppo_dp_run, tmp_path):
    """A PPO objective() written without share= (it would divide by its own rank's tokens) is refused at DP2 before
    setup: one failing row naming the plugin and its signature; nothing sealed."""
    from qualify.stages import stage_is_complete

    plugin = "tests.integration.contract_plugins:five_parameter_objective"
    m = dp2_matrix(tmp_path, engines=[plugin], dp=[2], roles=["actor"])
    verdict = run_candidates(m, ppo_dp_run).to_json()
    [case] = [c.name for c in m.cases()]
    [row] = [r for r in verdict["rows"] if r["case"] == case]
    assert row["comparison"] == "run" and not row["passed"] and "\n" not in row["note"], row
    assert (f"engine {plugin}: objective(role, ppo, scores_BT, mask_BT, targets) cannot take share=; under PPO at "
            "DP 2") in row["note"], row["note"]
    assert not stage_is_complete(RunLayout(ppo_dp_run).case(case))
