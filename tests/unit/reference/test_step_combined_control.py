"""The `combined` control: every other listed perturbation at once (an engine differs from the reference in several
legitimate ways together), with the TP split at the largest candidate degree."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import yaml

from qualify.errors import MatrixError
from qualify.matrix import load_matrix
from qualify.reference.step import CONTROL_ATTN, Control, combined_control, controls_of
from tests.unit._runs import REPO, synthetic_matrix


def _with(matrix, perturbations, tp=None):
    ref = dataclasses.replace(matrix.reference, perturbations=perturbations)
    cand = matrix.candidates if tp is None else dataclasses.replace(matrix.candidates, tp=tp)
    return dataclasses.replace(matrix, reference=ref, candidates=cand)


def test_combined_sets_every_other_perturbation_and_the_largest_tp(tmp_path):
    matrix = _with(load_matrix(REPO / "matrices" / "tiny-qwen3.yaml"), ("microbatch_split", "attn_impl", "tp_split", "optimizer_order",
                                                "combined"), tp=(2, 1))
    controls = {c.name: c for c in controls_of(matrix.reference, matrix.candidates.tp)}
    assert list(controls) == ["r0", "r1", "microbatch_split", "attn_impl", "tp2_split",
                              "optimizer_order", "combined"]
    assert controls["combined"] == Control(name="combined", microbatches=2, attn_impl=CONTROL_ATTN["attn_impl"],
                                           tp=2, adam_form="reordered")
    # each single control still changes one thing only
    assert controls["optimizer_order"] == Control(name="optimizer_order", adam_form="reordered")
    assert controls["microbatch_split"] == Control(name="microbatch_split", microbatches=2)


def test_combined_without_tp_split_or_at_tp1_stays_single_process_order(tmp_path):
    c = combined_control(("batch_order", "fused_projections", "combined"), max_tp=2)
    assert c == Control(name="combined", reverse_rows=True, fused=True)  # tp_split not listed: no split
    c = combined_control(("tp_split", "optimizer_order", "combined"), max_tp=4)
    assert c == Control(name="combined", tp=4, adam_form="reordered")  # the largest candidate degree
    c = combined_control(("tp_split", "optimizer_order", "combined"), max_tp=1)
    assert c == Control(name="combined", tp=1, adam_form="reordered")


@pytest.mark.parametrize("perturbations", [["combined"], ["optimizer_order", "combined"]])
def test_combined_needs_two_others(tmp_path, perturbations):
    data = yaml.safe_load((REPO / "matrices" / "tiny-qwen3.yaml").read_text())
    data["reference"]["perturbations"] = perturbations
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(MatrixError, match="combined .* needs at least two others"):
        load_matrix(path)


def test_split_then_fused_model_computes_the_same_function_in_float64():
    """The composition combined uses (TP split, then q/k/v and gate/up fused) changes reduction order only: in float64
    the logits and every gradient equal the plain model's to 1e-12 relative; the fused groups are one GEMM each and
    the row-parallel and vocabulary linears stay split (counted)."""
    from qualify.matrix import TinyModel
    from qualify.models.tiny import build_tiny_model
    from qualify.reference.tp_numerics import fuse_projections, split_like_tp

    spec = TinyModel(vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=32, max_position_embeddings=64, seed=3)
    plain, both = (build_tiny_model(spec, "actor").double() for _ in range(2))
    split_like_tp(both, 2)
    fuse_projections(both)
    widths = []
    real_linear = F.linear

    def counting(x, w, b=None):
        widths.append(w.shape[0])
        return real_linear(x, w, b)

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    a = plain(input_ids=ids).logits
    F.linear = counting
    try:
        b = both(input_ids=ids).logits
    finally:
        F.linear = real_linear
    qkv = 4 * 32 + 2 * 32 + 2 * 32
    # per layer: fused q/k/v whole, o_proj in 2 partial products, fused gate/up whole, down_proj in 2; head in 2 shards
    assert widths == [qkv, 64, 64, 2 * 64, 64, 64] * 2 + [64, 64]
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    a.pow(2).sum().backward()
    b.pow(2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), both.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12 * float(p.grad.abs().max())), name


def test_fused_norm_is_a_control_and_part_of_combined(tmp_path):
    matrix = _with(synthetic_matrix(tmp_path), ("fused_norm", "optimizer_order", "combined"))
    controls = {c.name: c for c in controls_of(matrix.reference, matrix.candidates.tp)}
    assert controls["fused_norm"] == Control(name="fused_norm", fused_norm=True)
    assert controls["combined"] == Control(name="combined", fused_norm=True, adam_form="reordered")
