"""Mixture of experts without vLLM: the tiny MoE family's parameters as every stage names them, the reference's route
replay (qualify.models.routing) against the model's own routing and against torch-tp's own replay, the capture's
route bookkeeping (qualify.rollout.routes), the replay rows (qualify.judge.derived) and the matrix's checks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from qualify.compare import RunTensors
from qualify.errors import EvidenceError, QualifyError
from qualify.judge.routing_rows import replay_check, replay_rows
from qualify.matrix import TinyModel, TinyMoE, load_matrix
from qualify.models.checkpoint import initial_parameters
from qualify.models.routing import agreement, own_routes_BTLK, routing
from qualify.models.tiny import build_tiny_model
from qualify.rolemeta import RoleMeta
from qualify.rollout.routes import request_routes, routes_tensor

ROOT = Path(__file__).resolve().parents[3]
SPEC = TinyModel(seed=7, vocab_size=128, moe=TinyMoE(num_experts=4, top_k=2, moe_intermediate_size=16))


@pytest.fixture(scope="module")
def actor():
    return build_tiny_model(SPEC, "actor")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, 127, (3, 9), generator=torch.Generator().manual_seed(0))


def own_routes(model, ids_BT):
    own: list = []
    with torch.no_grad(), routing(model, None, own):
        model(input_ids=ids_BT)
    return own_routes_BTLK(own, *ids_BT.shape)


def forward_backward(model, ids_BT, replay=None):
    model.zero_grad(set_to_none=True)
    with replay if replay is not None else routing(model, None):
        logits = model(input_ids=ids_BT).logits
        (logits.double().square().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_policies_are_qwen3_moe_and_the_critic_stays_dense():
    assert type(build_tiny_model(SPEC, "actor")).__name__ == "Qwen3MoeForCausalLM"
    assert type(build_tiny_model(SPEC, "reference")).__name__ == "Qwen3MoeForCausalLM"
    assert type(build_tiny_model(SPEC, "critic")).__name__ == "Qwen3ForTokenClassification"


def test_initial_parameters_are_the_loaded_models_parameters_by_name(tmp_path, actor):
    """The checkpoint stores each expert's projections apart; the loaded model fuses them: initial_parameters gives
    exactly what transformers' own loader makes, under the same names."""
    from qualify.models.hf import load_model

    actor.save_pretrained(tmp_path, safe_serialization=True)
    stored = initial_parameters(tmp_path)
    loaded = dict(load_model(tmp_path, "actor").named_parameters())
    assert sorted(stored) == sorted(loaded)
    assert all(torch.equal(stored[n], p.detach()) for n, p in loaded.items())
    assert stored["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, SPEC.hidden_size)


def test_checkpoint_layout_gives_back_the_checkpoints_own_tensors(tmp_path, actor):
    """A rounds version is the checkpoint plus the trainer's update, which is named as the model's parameters:
    checkpoint_layout undoes initial_parameters' fusing exactly, name for name (transformers' saved file is the
    independent side)."""
    from qualify.models.checkpoint import checkpoint_layout, checkpoint_tensors

    actor.save_pretrained(tmp_path, safe_serialization=True)
    saved = checkpoint_tensors(tmp_path)
    back = checkpoint_layout(initial_parameters(tmp_path))
    assert sorted(back) == sorted(saved) and all(torch.equal(back[n], saved[n]) for n in saved)
    swapped = initial_parameters(tmp_path)  # negative control: gate and up halves exchanged
    fused = swapped["model.layers.0.mlp.experts.gate_up_proj"]
    swapped["model.layers.0.mlp.experts.gate_up_proj"] = fused.roll(fused.shape[1] // 2, dims=1)
    wrong = checkpoint_layout(swapped)
    assert not torch.equal(wrong["model.layers.0.mlp.experts.0.gate_proj.weight"],
                           saved["model.layers.0.mlp.experts.0.gate_proj.weight"])


def test_initial_parameters_refuse_an_expert_without_one_of_its_projections(tmp_path, actor):
    from safetensors.torch import load_file, save_file

    actor.save_pretrained(tmp_path, safe_serialization=True)
    [path] = tmp_path.glob("*.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(EvidenceError, match=r"model.layers.1.mlp.experts does not hold"):
        initial_parameters(tmp_path)


def test_replaying_the_models_own_routes_changes_nothing_bit_for_bit(actor, ids):
    own = own_routes(actor, ids)
    plain = forward_backward(actor, ids)
    replayed = forward_backward(actor, ids, routing(actor, own))
    assert torch.equal(plain[0], replayed[0])
    assert all(torch.equal(plain[1][n], replayed[1][n]) for n in plain[1])
    # and where the rollout fed nothing (-1) the router's own top-k stands
    blank = forward_backward(actor, ids, routing(actor, torch.full_like(own, -1)))
    assert torch.equal(plain[0], blank[0])


def test_shifted_routes_change_the_outputs_and_the_router_still_gets_its_gradient(actor, ids):
    own = own_routes(actor, ids)
    shifted = torch.cat([torch.full_like(own[:, :1], -1), own[:, :-1]], dim=1)
    assert bool((shifted != own).any())
    plain = forward_backward(actor, ids)
    moved = forward_backward(actor, ids, routing(actor, shifted))
    assert float((moved[0] - plain[0]).abs().max()) > 1e-3
    for layer in range(SPEC.num_layers):
        assert float(moved[1][f"model.layers.{layer}.mlp.gate.weight"].abs().max()) > 0


def test_torch_tps_replay_and_the_references_agree_bit_for_bit(actor, ids):
    """Two implementations of the replay (a forward hook on the router; torch-tp's own router forward) on routes that
    differ from the model's own: the same logits and gradients."""
    from qualify.engines.torch_tp import routes_replayed

    own = own_routes(actor, ids)
    other = (own + 1) % SPEC.moe.num_experts  # another expert in every slot (still distinct per token)
    reference = forward_backward(actor, ids, routing(actor, other))
    engine = forward_backward(actor, ids, routes_replayed(actor, other))
    assert torch.equal(reference[0], engine[0])
    assert all(torch.equal(reference[1][n], engine[1][n]) for n in reference[1])


def test_routes_for_another_number_of_tokens_are_refused(actor, ids):
    own = own_routes(actor, ids)
    with pytest.raises(ValueError, match="routes for 18 tokens"), routing(actor, own[:2]):
        actor(input_ids=ids)


def test_agreement_counts_token_sets_and_slots_where_the_rollout_fed_a_token():
    rollout = torch.tensor([[[[0, 1]], [[2, 3]], [[1, 0]], [[-1, -1]]]], dtype=torch.int32)  # (1, 4, 1, 2)
    other = torch.tensor([[[[0, 1]], [[2, 0]], [[0, 1]], [[3, 2]]]], dtype=torch.int32)
    [a] = agreement(rollout, other)
    # position 1 routes elsewhere (3 -> 0); position 2 is the same set in the other order (2 slots differ); 3 unfed
    assert a == {"layer": 0, "tokens": 3, "tokens_differ": 1, "pairs": 6, "pairs_differ": 3}


def test_a_requests_routes_must_come_whole_and_alike_from_every_tp_rank():
    rank0 = {0: torch.tensor([[0, 1], [1, 2], [2, 3]], dtype=torch.int32), 1: torch.tensor([[3, 0]] * 3, dtype=torch.int32)}
    assert request_routes([rank0, dict(rank0)], [0, 1], 3, "request 0") == [[[0, 1], [3, 0]], [[1, 2], [3, 0]],
                                                                               [[2, 3], [3, 0]]]
    other = {0: rank0[0], 1: torch.tensor([[3, 1]] * 3, dtype=torch.int32)}
    with pytest.raises(QualifyError, match="TP rank 1 captured other routes"):
        request_routes([rank0, other], [0, 1], 3, "request 0")
    with pytest.raises(QualifyError, match="layer 0 captured 3 routed tokens, the request fed 4"):
        request_routes([rank0], [0, 1], 4, "request 0")
    with pytest.raises(QualifyError, match=r"captured layers \[0\]"):
        request_routes([{0: rank0[0]}], [0, 1], 3, "request 0")


def test_the_rollouts_routes_tensor_is_right_padded_with_no_route():
    results = [{"routes": [[[0, 1]], [[1, 2]]]}, {"routes": [[[3, 2]]]}]
    t = routes_tensor(results, 4)
    assert t.shape == (2, 4, 1, 2) and t.dtype == torch.int32
    assert t[0, :2].tolist() == [[[0, 1]], [[1, 2]]] and bool((t[0, 2:] == -1).all())
    assert t[1, 0].tolist() == [[3, 2]] and bool((t[1, 1:] == -1).all())


def test_the_replay_check_counts_pairs_whose_expert_set_differs_on_fed_tokens_only():
    given = torch.tensor([[[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[-1, -1], [-1, -1]]]])  # (1, 3, 2, 2)
    same = torch.tensor([[[[1, 0], [2, 3]], [[1, 2], [3, 0]], [[3, 2], [1, 0]]]])  # slot order and unfed: no matter
    assert replay_check(same, given) == {"pairs": 4, "differ": 0, "first": ""}
    wrong = same.clone()
    wrong[0, 1, 1] = torch.tensor([0, 2])
    found = replay_check(wrong, given, offset=5)
    assert found["differ"] == 1 and found["first"].startswith("row 5 position 1 MoE layer 1: routed to experts [0, 2]")
    assert replay_check(None, given) is None
    assert replay_check(same[:, :2], given)["differ"] == 4  # routes of another shape: every fed pair


def test_replay_rows_fail_on_any_pair_and_say_when_the_engine_cannot_show_its_routes():
    def case(found):
        return [RunTensors({}, {}, {}, {}, RoleMeta.from_json({"routing_replay": found}))]

    rows = replay_rows("c", "actor", case([{"pairs": 8, "differ": 0, "first": ""},
                                            {"pairs": 8, "differ": 2, "first": "row 0 position 3 MoE layer 1: x"}]))
    assert [(r.tensor, r.metric, r.passed) for r in rows] == [("step0/routing/replayed", "pairs_not_replayed", True),
                                                            ("step1/routing/replayed", "pairs_not_replayed", False)]
    assert rows[1].value == 2 and "2 of 8" in rows[1].note and "MoE layer 1" in rows[1].note
    [unseen] = replay_rows("c", "actor", case([None]))
    assert unseen.metric == "not_observed" and unseen.passed and "not verified" in unseen.note
    assert math.isinf(unseen.bound)
    assert replay_rows("c", "actor", [RunTensors({}, {}, {}, {})]) == []  # a case that replays nothing


def _matrix(tmp_path, edit):
    data = yaml.safe_load((ROOT / "matrices" / "tiny-qwen3-moe.yaml").read_text())
    edit(data)
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_matrix(path)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["rollout"].pop("routing"), "rollout.routing .replay or recompute. is required for a MoE family"),
    (lambda d: d["models"]["tiny"].pop("moe"), "refused for a dense one"),
    (lambda d: d["models"]["tiny"]["moe"].update(top_k=5), "top_k 5 is more than num_experts 4"),
    (lambda d: d["models"]["tiny"]["moe"].update(num_experts=1), "num_experts must be >= 2"),
    (lambda d: d["rollout"].update(routing="replayed"), "routing"),
])
def test_the_matrix_refuses_routing_settings_that_cannot_run(tmp_path, edit, message):
    with pytest.raises(Exception, match=message):
        _matrix(tmp_path, edit)


def test_the_shipped_moe_matrix_loads(tmp_path):
    m = _matrix(tmp_path, lambda d: None)
    assert m.models.tiny.moe == TinyMoE() and m.rollout.routing == "replay"


def test_megatron_may_run_beside_a_moe_actor(tmp_path):
    """megatron's conversion knows Qwen3-MoE (qualify.engines.megatron_convert) and replays routes through
    megatron-core's RouterReplay (tests/integration/test_megatron_moe.py): the tiny MoE family takes it at TP 1."""
    m = _matrix(tmp_path, lambda d: d["candidates"].update(engines=["torch-tp", "megatron"], tp=[1]))
    assert m.candidates.engines == ("torch-tp", "megatron") and m.models.tiny.moe is not None
    with pytest.raises(ValueError, match=r"megatron runs a Qwen3-MoE model at TP 1 only"):  # the shipped tp [1, 2]
        _matrix(tmp_path, lambda d: d["candidates"].update(engines=["torch-tp", "megatron"]))


def test_only_the_actor_of_a_replaying_matrix_replays(tmp_path):
    from qualify.models.routing import replayed_routes

    m = _matrix(tmp_path, lambda d: None)
    routes = torch.zeros(2, 3, 2, 2, dtype=torch.int32)
    batch = {"input_ids_BT": torch.zeros(2, 3, dtype=torch.long), "routes_BTLK": routes}
    assert replayed_routes(m.rollout, "actor", batch) is routes
    assert replayed_routes(m.rollout, "critic", batch) is None
    recompute = _matrix(tmp_path, lambda d: d["rollout"].update(routing="recompute"))
    assert replayed_routes(recompute.rollout, "actor", batch) is None
    with pytest.raises(ValueError, match="the rollout holds no routes"):
        replayed_routes(m.rollout, "actor", {"input_ids_BT": batch["input_ids_BT"]})


def test_router_outputs_are_the_first_forwards_logits_and_the_weights_used(actor, ids):
    """What a replaying forward records (the reference's step and OutputScoring.routed read it): the router's logits
    and the weights of the replayed experts, renormalized; a later forward in the same block (a recompute) is not
    taken."""
    from qualify.models.routing import ROUTER_OUTPUTS, router_outputs

    own = own_routes(actor, ids)
    other = (own + 1) % SPEC.moe.num_experts
    logits = {}
    handles = [layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: logits.__setitem__(i, out[0].detach()))
               for i, layer in enumerate(actor.model.layers)]
    recorded: list = []
    try:
        with torch.no_grad(), routing(actor, other, outputs=recorded):
            actor(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    out = router_outputs(recorded, *ids.shape)
    assert list(out) == list(ROUTER_OUTPUTS)
    assert out["router_logits_BTLE"].shape == (3, 9, 2, 4) and out["routing_weights_BTLK"].shape == (3, 9, 2, 2)
    for layer in range(2):
        probs = torch.softmax(logits[layer].double(), -1).reshape(3, 9, 4)
        picked = probs.gather(-1, other[:, :, layer].long())
        assert torch.allclose(out["routing_weights_BTLK"][:, :, layer].double(), picked / picked.sum(-1, keepdim=True),
                              rtol=0, atol=1e-6)
    assert router_outputs([], 3, 9) == {}
    with torch.no_grad(), routing(actor, None, outputs=recorded):
        actor(input_ids=ids)
        actor(input_ids=ids[:, :4])  # a later forward (a recompute's place): not taken
    assert router_outputs(recorded, *ids.shape)["router_logits_BTLE"].shape == (3, 9, 2, 4)


def test_a_checkpoints_model_type_and_the_routing_setting_must_agree(tmp_path):
    """A real family's model type is known once its config is read: the reference refuses a MoE actor without
    rollout.routing, a dense one with it, and megatron beside a MoE actor at a TP degree above 1, before anything
    runs."""
    import json

    from qualify.reference.stage import require_routing_setting

    dense, moe = tmp_path / "dense", tmp_path / "moe"
    for path, kind in ((dense, "qwen3"), (moe, "qwen3_moe")):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": kind, "num_attention_heads": 4, "vocab_size": 512,
                                                      "num_key_value_heads": 2, "intermediate_size": 128}))
    plain, routed = load_matrix(ROOT / "matrices" / "tiny-qwen3.yaml"), _matrix(tmp_path, lambda d: None)
    require_routing_setting(plain.rollout.routing, plain.candidates.engines, dense)
    require_routing_setting(routed.rollout.routing, routed.candidates.engines, moe)
    with pytest.raises(QualifyError, match="is a Qwen3-MoE actor: rollout.routing .* is required"):
        require_routing_setting(plain.rollout.routing, plain.candidates.engines, moe)
    with pytest.raises(QualifyError, match="is a dense Qwen3 actor"):
        require_routing_setting(routed.rollout.routing, routed.candidates.engines, dense)
    mega = _megatron(tmp_path)
    require_routing_setting(mega.rollout.routing, mega.candidates.engines, moe, (1,))  # megatron replays at TP 1
    with pytest.raises(QualifyError, match=r"megatron .* candidates.tp \[1, 2\]: megatron runs a Qwen3-MoE model at TP 1"):
        require_routing_setting(mega.rollout.routing, mega.candidates.engines, moe, (1, 2))


def _megatron(tmp_path):
    """The MoE matrix with megatron among its engines, past the tiny family's own check (a checkpoints family)."""
    data = yaml.safe_load((ROOT / "matrices" / "tiny-qwen3-moe.yaml").read_text())
    tiny = data["models"].pop("tiny")
    data["models"]["checkpoints"] = {role: str(tmp_path / "moe") for role in ("actor", "reference", "critic", "reward")}
    data["candidates"]["engines"] = ["torch-tp", "megatron"]
    assert tiny["moe"]
    path = tmp_path / "mega.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_matrix(path)


def test_a_replay_record_that_is_not_a_count_fails_its_row():
    meta = RoleMeta.from_json({"routing_replay": [{"differ": "none", "pairs": 8}]})
    [row] = replay_rows("c", "actor", [RunTensors({}, {}, {}, {}, meta)])
    assert not row.passed and math.isnan(row.value) and "nan of 8" in row.note
