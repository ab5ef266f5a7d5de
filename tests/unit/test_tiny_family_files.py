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
