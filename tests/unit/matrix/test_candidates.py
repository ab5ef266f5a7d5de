"""The packing axis of a matrix: candidates.packing and pack_tokens load, name their cases ...-packed-<role> (and the
verdict's case-name parser reads those names back), and each inconsistent setting is refused at load in one line
naming what is wrong: a budget missing, packed cases without the reference's packed control, a budget some
sample cannot fit, megatron (no packed attention without Transformer Engine), a MoE family."""

from __future__ import annotations

import copy

import pytest
import yaml

from qualify.matrix import Case, load_matrix
from qualify.reference.step import controls_of
from qualify.report_verify import CASE_NAME
from tests.unit.matrix.test_loader import MATRICES, TINY, load_error, write


def packed(**candidates) -> dict:
    data = copy.deepcopy(TINY)
    data["candidates"].update({"packing": ["padded", "packed"], "pack_tokens": 96} | candidates)
    data["reference"]["perturbations"] = ["microbatch_split", "attn_impl", "packed", "combined"]
    return data


def test_packed_cases_are_named_and_parsed_back(tmp_path):
    m = load_matrix(write(tmp_path, packed(engines=["torch-tp"], tp=[1], precisions=["fp32"])))
    names = [c.name for c in m.cases()]
    assert names == ["torch-tp-fp32-tp1-actor", "torch-tp-fp32-tp1-critic", "torch-tp-fp32-tp1-packed-actor",
                     "torch-tp-fp32-tp1-packed-critic"]
    for case in m.cases():
        parts = CASE_NAME.match(case.name)
        assert Case(engine=parts["engine"], precision=parts["precision"], tp=int(parts["tp"]), role=parts["role"],
                    dp=int(parts["dp"] or 1), packing=parts["packing"] or "padded") == case
    assert CASE_NAME.match("my-pkg-f-bf16-tp2-dp2-packed-critic")["packing"] == "packed"
    assert CASE_NAME.match("x-fp32-tp1-packed-padded-actor") is None


def test_the_packed_control_packs_the_candidates_budget(tmp_path):
    m = load_matrix(write(tmp_path, packed()))
    controls = {c.name: c for c in controls_of(m.reference, m.candidates.tp, m.candidates.pack_tokens)}
    assert controls["packed"].pack_tokens == 96 and controls["packed"].microbatches == 1
    assert controls["combined"].pack_tokens == 96 and controls["combined"].attn_impl == "eager"
    assert controls["microbatch_split"].pack_tokens is None


def test_padded_matrices_are_unchanged():
    m = load_matrix(MATRICES / "tiny-qwen3.yaml")
    assert m.candidates.packing == ("padded",) and m.candidates.pack_tokens is None
    assert all(c.packing == "padded" and "packed" not in c.name for c in m.cases())


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["candidates"].pop("pack_tokens"), ("packing lists packed: pack_tokens (the token budget of a packed "
                                                   "micro-batch) is required")),
    (lambda d: d["reference"].update(perturbations=["microbatch_split"]),
     "candidates.packing lists packed: reference.perturbations must list packed"),
    (lambda d: d["candidates"].update(pack_tokens=39), ("candidates.pack_tokens 39 is less than the longest sample, "
                                                       "rollout.prompt_len 16 + max_new_tokens 24 = 40 tokens")),
    (lambda d: d["candidates"].update(pack_tokens=0), "pack_tokens must be >= 1 or null, got 0"),
    (lambda d: d["candidates"].update(packing=["packed", "packed"]), "packing lists ['packed'] more than once"),
    (lambda d: d["candidates"].update(engines=["torch-tp", "megatron"]),
     ("packing lists packed, which engine megatron cannot take: megatron-core's local layer spec (no Transformer "
     "Engine) attends with DotProductAttention, which refuses packed sequences")),
    (lambda d: d["candidates"].update(packing=["sorted"]), "candidates.packing"),
])
def test_inconsistent_packing_is_refused_at_load(tmp_path, edit, message):
    data = packed()
    edit(data)
    assert message in load_error(tmp_path, data)


def test_a_moe_family_is_refused_packed(tmp_path):
    moe = yaml.safe_load((MATRICES / "tiny-qwen3-moe.yaml").read_text())
    moe["candidates"].update({"packing": ["packed"], "pack_tokens": 4096})
    moe["reference"]["perturbations"] = list(moe["reference"].get("perturbations", [])) + ["packed"]
    assert "packed batches are not built for a MoE family (rollout.routing)" in load_error(tmp_path, moe)
