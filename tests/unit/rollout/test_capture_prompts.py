"""rollout.prompts_file is read as token ids exactly: anything else is a one-line error naming the file and prompt,
never a silent conversion (1.9 was token 1, true was token 1) or a read without end (/dev/zero)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qualify.errors import QualifyError
from qualify.rollout.capture import read_prompts


def write(tmp_path: Path, data) -> Path:
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("data, expect", [
    ([[1, 2], [3, 1.9]], "prompt 1 holds 1.9, not a token id"),
    ([[1, True]], "prompt 0 holds True"),
    ([[1, "2"]], "prompt 0 holds '2'"),
    ([[1, [2]]], "prompt 0 holds [2]"),
    ([[1, 600]], "prompt 0 holds 600, not a token id (an integer in [0, 512))"),
    ([[1, -1]], "prompt 0 holds -1"),
    ([[1], []], "expected a JSON list of non-empty token-id lists"),
    ({"a": [1]}, "expected a JSON list"),
    ([[1]], "holds 1 prompts, rollout.num_prompts is 2"),
])
def test_anything_but_token_ids_is_refused_naming_it(tmp_path, data, expect):
    with pytest.raises(QualifyError) as caught:
        read_prompts(write(tmp_path, data), 2 if expect.startswith("holds") or len(data) > 1 else 1, 512)
    assert expect in str(caught.value) and str(tmp_path) in str(caught.value)


def test_a_device_or_a_huge_file_is_not_read(tmp_path):
    with pytest.raises(QualifyError, match="must be a regular file of at most 64 MiB"):
        read_prompts(Path("/dev/zero"), 2, 512)
    with pytest.raises(QualifyError, match="must be a regular file"):
        read_prompts(tmp_path, 2, 512)


def test_token_ids_are_read_as_they_are(tmp_path):
    assert read_prompts(write(tmp_path, [[1, 2, 3], [0, 511], [7]]), 2, 512) == [[1, 2, 3], [0, 511]]
