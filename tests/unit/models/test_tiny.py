"""The tiny family's checkpoint files follow the umask like every other file of a run (save_pretrained writes the
weights 0600 whatever it is, so another user of a shared run directory could not read them)."""

from __future__ import annotations

import os
import stat

from qualify.matrix import load_matrix
from qualify.models.tiny import make_tiny_family
from tests.conftest import TINY


def test_weights_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        paths = make_tiny_family(load_matrix(TINY).models.tiny, tmp_path / "models")
    finally:
        os.umask(old)
    for role, directory in paths.items():
        for name in ("model.safetensors", "config.json"):
            mode = stat.S_IMODE((directory / name).stat().st_mode)
            assert mode == 0o644, (role, name, oct(mode))


def test_a_family_made_in_parallel_processes_is_the_family_made_in_turn(tmp_path, monkeypatch):
    """Large families are made one role per process (qualify.models.tiny.PARALLEL_PARAMETERS): each role's
    weights are drawn from its own seed, so the files are the serial ones byte for byte; the embedded default's
    family, made both ways here (the threshold lowered), shows it."""
    import dataclasses

    from qualify.models import tiny

    spec = load_matrix(TINY).models.tiny
    assert tiny.family_workers(spec, 4) == 1  # the embedded default is made in turn
    serial = make_tiny_family(spec, tmp_path / "serial")
    monkeypatch.setattr(tiny, "PARALLEL_PARAMETERS", 1)
    assert tiny.family_workers(spec, 4) > 1 or os.cpu_count() == 1
    parallel = make_tiny_family(spec, tmp_path / "parallel")
    for role in tiny.SEED_OFFSETS:
        assert (serial[role] / "model.safetensors").read_bytes() == (parallel[role] / "model.safetensors").read_bytes()
    # the estimate the threshold is held to: Qwen3-0.6B's shape is 596M parameters (tied head), its norms aside
    q06 = dataclasses.replace(spec, vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True)
    assert 595e6 < tiny.policy_parameters(q06) < 596.1e6
