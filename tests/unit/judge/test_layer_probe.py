"""The exact tier's layer evidence (qualify.judge.layer_probe, qualify.rollout.layers): which positions are
compared, the per-layer count of tokens whose vector is not bitwise the rollout's, the note that names the first layer
that differs, and the capture's refusals."""

from __future__ import annotations

import pytest
import torch

from qualify.errors import QualifyError
from qualify.judge.layer_probe import (
    NO_HOOK,
    NOT_CAPTURED,
    compare_layers,
    layers_note,
    merge_ranks,
    scoring_mask,
)
from qualify.matrix import Rollout
from qualify.rollout.layers import layer_names, layers_tensors, split_forwards

NAMES = layer_names(3)


def activations(B: int = 3, T: int = 7, H: int = 5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(B, T, H, generator=gen) for name in NAMES}


def response_mask() -> torch.Tensor:
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0, 3:7] = True  # a row that fills T
    mask[1, 2:5] = True  # a row followed by padding
    mask[2, 4:6] = True
    return mask


def test_a_token_is_compared_at_the_position_that_predicts_it():
    mask = response_mask()
    expected = torch.zeros_like(mask)
    for b in range(mask.shape[0]):
        for t in range(1, mask.shape[1]):
            expected[b, t - 1] = mask[b, t]
    assert torch.equal(scoring_mask(mask), expected)
    assert int(scoring_mask(mask).sum()) == int(mask.sum())


def test_one_changed_token_names_its_layer_first_with_the_right_counts():
    rollout, mask = activations(), scoring_mask(response_mask())
    own = {name: t.clone() for name, t in rollout.items()}
    assert [e["num_not_bitwise"] for e in compare_layers(own, rollout, NAMES, mask)] == [0, 0, 0, 0]
    own["model.layers.1"][1, 1, 4] = torch.nextafter(own["model.layers.1"][1, 1, 4], torch.tensor(1.0))  # one ulp
    own["model.layers.2"][1, 1:4] += 1.0  # the change spreads to the later positions of its row
    own["model.norm"][1, 1:4] += 1.0
    own["model.layers.2"][1, 6] += 1.0  # padding: not a position that predicts a response token
    found = compare_layers(own, rollout, NAMES, mask)
    assert [(e["name"], e["num_tokens"], e["num_not_bitwise"]) for e in found] == [
        ("model.layers.0", 9, 0), ("model.layers.1", 9, 1), ("model.layers.2", 9, 3), ("model.norm", 9, 3)]
    note = layers_note({"layers": found}, declared=True)
    assert note == ("; layers against the rollout engine's prefill: model.layers.0 bitwise, first differing "
                    "model.layers.1 (1 of 9 tokens), model.norm 3 of 9")


def test_a_layer_the_engine_does_not_give_counts_every_token():
    rollout, mask = activations(), scoring_mask(response_mask())
    own = {name: t.clone() for name, t in rollout.items() if name != "model.layers.0"}
    found = compare_layers(own, rollout, NAMES, mask)
    assert (found[0]["num_not_bitwise"], found[0].get("missing")) == (9, True)
    assert layers_note({"layers": found}, True).startswith(
        "; layers against the rollout engine's prefill: first differing model.layers.0 (9 of 9 tokens), model.norm 0")


def test_the_note_says_every_layer_bitwise_or_why_nothing_was_compared():
    rollout, mask = activations(), scoring_mask(response_mask())
    same = {"layers": compare_layers(rollout, rollout, NAMES, mask)}
    assert layers_note(same, True) == ("; layers against the rollout engine's prefill: all 4 bitwise (model.layers.0 "
                                       "to model.norm, 9 tokens)")
    assert layers_note({"skipped": NOT_CAPTURED}, True) == f"; layers: {NOT_CAPTURED}"
    assert layers_note({"skipped": NO_HOOK}, True) == f"; layers: {NO_HOOK}"
    assert "no layer probe" in layers_note(None, True)
    assert layers_note(None, False) == "" and layers_note(same, False) == ""


def test_dp_ranks_counts_add_up():
    rollout, mask = activations(), scoring_mask(response_mask())
    own = {name: t + 1 for name, t in rollout.items()}
    one = {"layers": compare_layers(own, rollout, NAMES, mask)}
    merged = merge_ranks([one, one])
    assert [(e["num_tokens"], e["num_not_bitwise"]) for e in merged["layers"]] == [(18, 18)] * 4
    assert merge_ranks([{"skipped": NO_HOOK}, {"skipped": NO_HOOK}]) == {"skipped": NO_HOOK}


def test_the_capture_pads_rows():
    a, b = torch.ones(4, 2), torch.full((2, 2), 2.0)
    out = layers_tensors({0: {"model.norm": a}, 2: {"model.norm": b}}, [4, 3, 2])
    assert out["model.norm"].shape == (3, 4, 2) and out["model.norm"].dtype == torch.float32
    assert torch.equal(out["model.norm"][0], a) and not out["model.norm"][1].any()
    assert torch.equal(out["model.norm"][2, :2], b) and not out["model.norm"][2, 2:].any()


def _forwards(sequences: dict[int, list[int]], forwards: list[list[tuple[int, int]]], names: list[str]):
    """take()'s answer for forwards that feed (sequence, position) rows in the given order: each row's activation
    is 100 x sequence + position in every column, so that a misplaced row shows."""
    fed, acts = [], {name: [] for name in names}
    for rows in forwards:
        fed.append((torch.tensor([sequences[b][p] for b, p in rows]), torch.tensor([p for _, p in rows])))
        for name in names:
            acts[name].append(torch.tensor([[100.0 * b + p] * 3 for b, p in rows]))
    return {"acts": acts, "fed": fed}


def _placed(out: dict[int, dict], names: list[str]) -> bool:
    return all(torch.equal(t[:, 0], 100.0 * b + torch.arange(t.shape[0])) for b, acts in out.items()
               for t in acts.values()) and all(set(acts) == set(names) for acts in out.values())


def test_the_batched_prefill_gives_each_row_back_to_its_sequence():
    names = layer_names(1)
    # rows 0 and 3 share their prompt (GRPO's groups), row 3 fed before row 0; row 5 is not fed (no room)
    seqs = {0: [7, 8, 9, 1, 2], 3: [7, 8, 9, 4], 4: [5, 6, 2]}
    one = [[(3, p) for p in range(4)] + [(0, p) for p in range(5)] + [(4, p) for p in range(3)]]
    out = split_forwards(_forwards(seqs, one, names), names, seqs)
    assert sorted(out) == [0, 3, 4] and _placed(out, names)
    # a chunked prefill: sequence 0 split over two forwards, its second chunk fed right after sequence 4
    chunked = [[(4, p) for p in range(3)] + [(0, 0), (0, 1)], [(0, 2), (0, 3), (0, 4)] + [(3, p) for p in range(4)]]
    assert _placed(split_forwards(_forwards(seqs, chunked, names), names, seqs), names)


def test_the_batched_prefill_refuses_rows_it_cannot_place():
    names = layer_names(1)
    seqs = {0: [7, 8, 9], 1: [5, 6]}
    whole = [[(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]]
    cached = [[(0, 1), (0, 2), (1, 0), (1, 1)]]  # a cached prefix: position 0 of row 0 never computed
    with pytest.raises(QualifyError, match=r"positions no forward computed, per row \{0: 1\}"):
        split_forwards(_forwards(seqs, cached, names), names, seqs)
    stranger = _forwards(seqs, whole, names)
    stranger["fed"][0][0][4] = 42  # a token no sequence holds at that position
    with pytest.raises(QualifyError, match="row 4 .token 42 at position 1. belongs to no sequence"):
        split_forwards(stranger, names, seqs)
    twice = _forwards(seqs, whole + [[(1, 1)]], names)  # position 1 of row 1 computed again
    with pytest.raises(QualifyError, match="belongs to no sequence of the pass that still lacks it"):
        split_forwards(twice, names, seqs)
    padded = _forwards(seqs, whole, names)
    padded["acts"][names[0]][0] = torch.zeros(8, 3)
    with pytest.raises(QualifyError, match="fed 5 tokens, model.layers.0 returned 8 rows"):
        split_forwards(padded, names, seqs)
    missing = _forwards(seqs, whole, names)
    del missing["acts"]["model.norm"]
    with pytest.raises(QualifyError, match="expected"):
        split_forwards(missing, names, seqs)


def test_the_matrix_refuses_layer_outputs_where_the_capture_cannot_make_them():
    base = {"num_prompts": 1, "prompt_len": 1, "max_new_tokens": 1}
    assert Rollout(vllm_tp=(1, 2), layer_outputs=True, **base).layer_outputs
    with pytest.raises(ValueError, match="primary rollout at vLLM TP1"):
        Rollout(vllm_tp=(2, 1), layer_outputs=True, **base)
    with pytest.raises(ValueError, match="dense actor"):
        Rollout(vllm_tp=(1,), layer_outputs=True, routing="replay", **base)
