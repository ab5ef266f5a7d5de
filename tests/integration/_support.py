"""Helpers shared by the engine integration tests: plugin modules importable by workers, matrix variants."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from qualify.matrix import load_matrix

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def plugins_importable(monkeypatch):
    """Workers launched by torchrun import 'tests.integration.*' plugin engines from the repo root."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def matrix_with(tmp_path: Path, **candidates):
    """The embedded default's matrix with its candidates section changed, written under tmp_path."""
    data = yaml.safe_load((REPO / "matrices" / "tiny-qwen3.yaml").read_text())
    data["candidates"].update(candidates)
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_matrix(path)
