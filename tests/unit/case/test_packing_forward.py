"""transformers' packed position_ids path, which torch-tp, deepspeed and the reference's packed control score packed
micro-batches through: with no attention mask, the position ids restarting at 0 mark the samples
(masking_utils.find_packed_sequence_indices) and attention stays within each sample, so each sample's packed logits
are its own forward's (sdpa and eager, fp32 and bf16, actor and critic). Position ids that continue across the pack
merge the samples into one causal sequence, which moves them by far more than rounding."""

from __future__ import annotations

import pytest
import torch

from qualify.case.context import Batch
from qualify.case.packing import pack_rows, sample_lengths
from qualify.matrix import TinyModel

SPEC = TinyModel(seed=7, vocab_size=96, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32, max_position_embeddings=64)
LENGTHS = [11, 6, 9]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from qualify.models.tiny import build_tiny_model

    out = {}
    for role in ("actor", "critic"):
        path = tmp_path_factory.mktemp(role)
        build_tiny_model(SPEC, role).save_pretrained(path, safe_serialization=True)
        out[role] = path
    return out


def packed_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, SPEC.vocab_size, (len(LENGTHS), 12), generator=g)
    prompt = torch.zeros_like(ids, dtype=torch.bool)
    response = torch.zeros_like(prompt)
    for b, n in enumerate(LENGTHS):
        ids[b, n:] = 0
        prompt[b, :4] = True
        response[b, 4:n] = True
    batch = Batch(input_ids_BT=ids, response_mask_BT=response)
    return batch, pack_rows(ids, response, sample_lengths(prompt, response), slice(0, len(LENGTHS)))


def test_transformers_finds_the_samples_from_the_position_ids():
    from transformers.masking_utils import find_packed_sequence_indices

    _, packed = packed_batch()
    found = find_packed_sequence_indices(packed.position_ids_1N)
    assert found[0].tolist() == [s for s, n in enumerate(LENGTHS) for _ in range(n)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_each_packed_sample_is_its_own_forward(models, attn, dtype, role):
    from qualify.models.hf import load_model

    model = load_model(models[role], role, attn, dtype)
    batch, packed = packed_batch()
    with torch.no_grad():
        out = model(input_ids=packed.input_ids_1N, position_ids=packed.position_ids_1N, use_cache=False).logits[0]
        merged = model(input_ids=packed.input_ids_1N, use_cache=False).logits[0]  # positions continue
        worst, moved = 0.0, 0.0
        for s, n in enumerate(LENGTHS):
            own = model(input_ids=batch.input_ids_BT[s:s + 1, :n], use_cache=False).logits[0]
            start = int(packed.cu_seqlens_S1[s])
            worst = max(worst, float((out[start:start + n].float() - own.float()).abs().max()))
            if s:
                moved = max(moved, float((merged[start:start + n].float() - own.float()).abs().max()))
    # one bf16 rounding step of these logits (|x| < 4) is 2^-6: another kernel's rounding, never another sample's
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -5
    assert worst <= tolerance
    assert moved > 10 * tolerance
