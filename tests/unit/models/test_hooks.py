"""Forward-hook capture of an HF Qwen3's per-layer activations: names, values, and control-style forwards."""

from __future__ import annotations

import pytest
import torch

from qualify.models.hooks import activation_names, capture_layer_outputs, capture_outputs, hooked_modules

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    config = transformers.Qwen3Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=64)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config).eval()


IDS = torch.randint(0, 64, (5, 7), generator=torch.Generator().manual_seed(1))


def test_every_module_of_every_layer_in_forward_order_with_the_models_own_values(model):
    acts = capture_layer_outputs(model, IDS)
    assert list(acts) == activation_names(3) and all(t.shape == (5, 7, 32) and t.dtype == torch.float32
                                                    for t in acts.values())
    with torch.no_grad():
        hidden = model(input_ids=IDS, output_hidden_states=True).hidden_states  # embeddings, layer outputs, final norm
    for i in range(2):
        assert torch.equal(acts[f"model.layers.{i}"], hidden[i + 1])
    assert torch.equal(acts["model.norm"], hidden[-1])
    layer0 = model.model.layers[0]
    with torch.no_grad():
        assert torch.equal(acts["model.layers.0.post_attention_layernorm"],
                           layer0.post_attention_layernorm(hidden[0] + acts["model.layers.0.self_attn"]))
    hooks_before = [len(m._forward_hooks) for _, m in hooked_modules(model)]  # transformers adds its own
    capture_layer_outputs(model, IDS)
    assert [len(m._forward_hooks) for _, m in hooked_modules(model)] == hooks_before  # ours are removed


def test_split_and_reversed_forwards_line_up_row_for_row(model):
    plain = capture_layer_outputs(model, IDS)
    for microbatches, reverse in ((2, False), (3, True), (1, True)):
        other = capture_layer_outputs(model, IDS, microbatches, reverse)
        assert list(other) == list(plain)
        for name in plain:  # same rows; values within rounding of a different batch shape
            torch.testing.assert_close(other[name], plain[name], rtol=1e-5, atol=1e-6)


def test_capture_outputs_concatenates_calls_and_transposes_seq_first():
    lin = torch.nn.Linear(3, 3)
    x_TBH = torch.randn(4, 2, 3)
    got = capture_outputs([("lin", lin)], lambda: [lin(x_TBH), lin(x_TBH[:, :1])], seq_first=True)
    with torch.no_grad():
        want = torch.cat([lin(x_TBH).transpose(0, 1), lin(x_TBH[:, :1]).transpose(0, 1)])
    assert torch.equal(got["lin"], want) and got["lin"].shape == (3, 4, 3)
