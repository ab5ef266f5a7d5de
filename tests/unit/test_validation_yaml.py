"""YAML-level input rules (qualify/schema.py): UTF-8 only, no duplicate keys, no alias bombs or recursive aliases,
no traceback on deep nesting, and every message is one short line, whatever the size of the offending value."""

from __future__ import annotations

import time

import pytest
import yaml

from qualify.errors import MatrixError
from qualify.matrix import load_matrix
from qualify.schema import MAX_YAML_NODES, parse_yaml
from qualify.slurm.profile import load_profile
from tests.unit.matrix.test_loader import TINY

TINY_TEXT = yaml.safe_dump(TINY, sort_keys=False)


def matrix_error(tmp_path, text: str | bytes) -> str:
    path = tmp_path / "m.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    with pytest.raises(MatrixError) as info:
        load_matrix(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message and len(message) < 400, message
    return message


def alias_bomb(levels: int) -> str:
    """levels of 9-fold aliases: 9**levels leaves from a dozen lines."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "\n".join(lines) + f"\nname: *a{levels}\n"


def test_non_utf8_matrix(tmp_path):
    message = matrix_error(tmp_path, TINY_TEXT.encode().replace(b"Tiny Qwen3", b"Tiny \xe9 Qwen3"))
    assert "not UTF-8 text (byte 0xe9 at offset" in message and "save the file as UTF-8" in message


def test_non_utf8_cluster_profile(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"gpus_per_node: 0\ncpus_per_node: 2\npartition: \xff\n")
    with pytest.raises(MatrixError, match=r"c.yaml: not UTF-8 text \(byte 0xff"):
        load_profile(path)


@pytest.mark.parametrize("levels", [5, 9])  # 59,049 and 387,420,489 values once expanded
def test_alias_bomb_is_refused_fast_without_the_expanded_value(tmp_path, levels):
    started = time.monotonic()
    message = matrix_error(tmp_path, alias_bomb(levels))
    assert f"YAML holds more than {MAX_YAML_NODES} values once its aliases are expanded" in message
    assert "lol" not in message
    assert time.monotonic() - started < 2


def test_recursive_alias(tmp_path):
    assert "line 1: a YAML alias refers to itself" in matrix_error(tmp_path, "name: &x [a, *x]\n")


def test_small_aliases_still_load(tmp_path):
    text = TINY_TEXT.replace("  precisions:\n  - fp32\n  - bf16\n  repeats", "  precisions: &both\n  - fp32\n  - bf16\n  repeats")
    text = text.replace("candidates:\n  engines:\n  - torch-tp\n  - deepspeed\n  precisions:\n  - fp32\n  - bf16\n",
                        "candidates:\n  engines:\n  - torch-tp\n  - deepspeed\n  precisions: *both\n")
    assert "*both" in text
    assert load_matrix(_write(tmp_path, text)).candidates.precisions == ("fp32", "bf16")


@pytest.mark.parametrize("text, line", [
    ("name: a\nname: b\n", 2),
    ("models:\n  tiny:\n    seed: 1\n    seed: 2\n", 4),
    ("freeze:\n  floors: {grad: 1.0, grad: 2.0}\n", 2),
])
def test_duplicate_keys_are_refused(tmp_path, text, line):
    message = matrix_error(tmp_path, text)
    assert f"line {line}: duplicate key" in message and "each key may appear once" in message


def test_merge_keys_may_override(tmp_path):
    assert parse_yaml("base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  y: 3\n", "t.yaml")["d"] == {"x": 1, "y": 3}


@pytest.mark.parametrize("text, expected", [
    ("name: " + "[" * 100_000 + "]" * 100_000 + "\n", "not valid YAML: nested too deeply"),
    ("name: ok\x07\n", "not valid YAML: unacceptable character #x0007"),
    ("name: [unclosed\n", "not valid YAML: line 2, column 1: expected ',' or ']'"),
    ("name: !!python/object:os.system x\n", "not valid YAML: line 1, column 7: could not determine a constructor"),
])
def test_malformed_yaml_is_one_line(tmp_path, text, expected):
    assert expected in matrix_error(tmp_path, text)


def test_a_huge_value_is_quoted_briefly(tmp_path):
    message = matrix_error(tmp_path, "name: [" + ", ".join(["x" * 1000] * 500) + "]\n")
    assert "name: expected str, got ['xxx" in message and "...]" in message


def test_a_long_or_multiline_key_is_quoted(tmp_path):
    data = dict(TINY)
    data["bad\nkey" + "k" * 200] = 1
    message = matrix_error(tmp_path, yaml.safe_dump(data))
    assert "unknown key 'bad\\nkey" in message


def _write(tmp_path, text):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    return path
