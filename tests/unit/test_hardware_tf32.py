"""qualify.hardware records TF32 however the process set it. vLLM's batch-invariant mode sets cuDNN's conv and RNN
precisions apart through torch's new API, after which torch's legacy `cudnn.allow_tf32` raises: the platform
fingerprint of a batch-invariant capture failed so on one H200 (vLLM 0.26.0, torch 2.11), before any token."""

from __future__ import annotations

import pytest
import torch

from qualify.hardware import tf32_settings


@pytest.fixture
def restored():
    conv, rnn = torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision
    yield
    torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision = conv, rnn


def test_tf32_is_recorded_after_the_new_api_set_conv_and_rnn_apart(restored):
    assert set(tf32_settings(torch)) == {"tf32_matmul", "tf32_cudnn"}  # the legacy flags while they can be read
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    torch.backends.cudnn.rnn.fp32_precision = "ieee"
    with pytest.raises(RuntimeError, match="legacy and new APIs"):  # what the fingerprint read before
        _ = torch.backends.cudnn.allow_tf32
    settings = tf32_settings(torch)
    assert settings["fp32_precision.cudnn_conv"] == "tf32" and settings["fp32_precision.cudnn_rnn"] == "ieee"
    assert "fp32_precision.matmul" in settings
