"""Localization logic of qualify diagnose on hand-built numbers: computation order, the first departure, layers."""

from __future__ import annotations

import math

from qualify.bounds.layers import layer_index
from qualify.diagnose.localize import MISSING, by_layer, first_departure, judge_layers, order_key
from qualify.models.hooks import activation_names


def entry(bound: float) -> dict:
    return {"bound": bound, "control_error": 0.0, "floor": bound, "kind": "value", "quantum": 0.0}


def bounds_for(num_layers: int) -> dict:
    """Every layer key of a model, each metric bounded by 1.0 (so a value is its own ratio)."""
    keys = [f"act/{n}" for n in activation_names(num_layers)]
    keys += ["grads/head", "grads/model.embed_tokens"] + [f"grads/model.layers.{i}" for i in range(num_layers)]
    return {k: {"max_abs": entry(1.0), "rel_l2": entry(1.0)} for k in keys}


def all_within(bounds: dict, value: float = 0.5) -> dict:
    return {k: {m: value for m in ms} for k, ms in bounds.items()}


def test_computation_order_forward_by_module_then_backward_from_the_head():
    keys = sorted(bounds_for(3), key=order_key)
    assert keys[:6] == ["act/model.layers.0.input_layernorm", "act/model.layers.0.self_attn",
                        "act/model.layers.0.post_attention_layernorm", "act/model.layers.0.mlp",
                        "act/model.layers.0", "act/model.layers.1.input_layernorm"]
    assert keys[15:] == ["act/model.norm", "grads/head", "grads/model.layers.2", "grads/model.layers.1",
                         "grads/model.layers.0", "grads/model.embed_tokens"]
    assert layer_index("model.layers.12.mlp") == 12 and layer_index("model.norm") is None
    assert layer_index("model.layers_x.1") is None


def test_correct_candidate_has_no_departure_and_every_layer_within_bound():
    b = bounds_for(3)
    rows = judge_layers(all_within(b), b)
    assert len(rows) == 2 * len(b) and all(r.passed for r in rows)
    assert first_departure(rows) is None
    layers = by_layer(rows)
    assert [x["layer"] for x in layers] == ["embedding", "0", "1", "2", "final norm", "head"]
    assert all(v is None or v == 0.5 for x in layers for v in (x["forward"], x["backward"]))


def test_fault_in_layer_1_spreads_downstream_but_is_named_where_it_starts():
    b = bounds_for(3)
    measured = all_within(b)
    # a wrong attention scale in layer 1: its self_attn output and everything after it leave their bounds,
    # including every gradient (the backward runs through the faulty forward)
    downstream = [k for k in sorted(b, key=order_key) if order_key(k) >= order_key("act/model.layers.1.self_attn")]
    for i, k in enumerate(downstream):
        measured[k] = {"max_abs": 10.0 + i, "rel_l2": 3.0}
    first = first_departure(judge_layers(measured, b))
    assert (first.key, first.layer, first.phase, first.metric) == ("act/model.layers.1.self_attn", "1", "forward",
                                                                   "max_abs")
    assert first.value == 10.0 and first.ratio == 10.0


def test_first_departure_reports_the_worst_metric_of_the_first_failing_tensor():
    b = bounds_for(2)
    measured = all_within(b)
    measured["act/model.layers.0.mlp"] = {"max_abs": 2.0, "rel_l2": 7.0}
    measured["act/model.layers.1.mlp"] = {"max_abs": 100.0, "rel_l2": 100.0}  # worse, but later
    first = first_departure(judge_layers(measured, b))
    assert (first.key, first.metric, first.ratio) == ("act/model.layers.0.mlp", "rel_l2", 7.0)


def test_backward_only_fault_is_named_by_the_first_gradient_group_the_backward_reaches():
    b = bounds_for(3)
    measured = all_within(b)
    # a gradient reduction forgotten in layer 1 only: layer 1's gradients and everything the backward computes
    # after it (layer 0, embedding) are off; the forward and the head are exact
    for k in ("grads/model.layers.1", "grads/model.layers.0", "grads/model.embed_tokens"):
        measured[k] = {"max_abs": 5.0, "rel_l2": 0.1}
    rows = judge_layers(measured, b)
    first = first_departure(rows)
    assert (first.key, first.layer, first.phase) == ("grads/model.layers.1", "1", "backward")
    assert {x["layer"]: x["backward"] for x in by_layer(rows)}["2"] == 0.5


def test_a_tensor_the_candidate_lacks_fails_and_nan_is_out_of_bound():
    b = bounds_for(1)
    measured = all_within(b)
    del measured["act/model.layers.0.self_attn"]
    measured["act/model.layers.0.mlp"] = {"max_abs": math.nan, "rel_l2": 0.5}
    rows = judge_layers(measured, b, problems={})
    first = first_departure(rows)
    assert first.key == "act/model.layers.0.self_attn" and first.note == MISSING and first.value == math.inf
    nan_row = next(r for r in rows if r.key == "act/model.layers.0.mlp" and r.metric == "max_abs")
    assert not nan_row.passed and nan_row.ratio == math.inf
    assert nan_row.to_json()["value"] == "nan"


def test_without_the_forward_only_gradients_are_judged():
    b = bounds_for(2)
    measured = {k: v for k, v in all_within(b).items() if k.startswith("grads/")}
    rows = judge_layers(measured, b, forward=False)
    assert rows and all(r.phase == "backward" and r.passed for r in rows)


def test_a_zero_bound_passes_only_an_exact_value():
    b = {"act/model.norm": {"max_abs": entry(0.0)}}
    assert judge_layers({"act/model.norm": {"max_abs": 0.0}}, b)[0].passed
    row = judge_layers({"act/model.norm": {"max_abs": 1e-30}}, b)[0]
    assert not row.passed and row.ratio == math.inf


def test_a_layer_row_is_a_verdict_row_and_writes_the_diagnosis_shape():
    from qualify.diagnose.localize import LAYERS, LayerRow
    from qualify.verdict import Row, worst_row

    b = bounds_for(1)
    measured = all_within(b)
    measured["act/model.layers.0.mlp"] = {"max_abs": math.inf, "rel_l2": 2.0}
    rows = judge_layers(measured, b)
    assert all(isinstance(r, Row) and r.comparison == LAYERS and r.tensor == r.key for r in rows)
    row = next(r for r in rows if r.key == "act/model.layers.0.mlp" and r.metric == "max_abs")
    assert row.to_json() == {"key": "act/model.layers.0.mlp", "metric": "max_abs", "value": "inf", "bound": 1.0,
                             "passed": False, "note": "", "phase": "forward", "layer": "0", "ratio": "inf"}
    assert worst_row(rows) == row  # the verdict's own helpers read layer rows
    assert LayerRow("grads/head", "rel_l2", 0.5, 1.0, True).to_json()["layer"] == "head"
