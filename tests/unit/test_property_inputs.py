"""Property: whatever a matrix or a manifest holds, `qualify matrices validate` and `qualify verify` end with
exit 0/1 (valid input: a result) or exit 2 and exactly one line on stderr (invalid input), never a traceback.

Inputs are the shipped tiny matrix and a real manifest, mutated at random: a value replaced by anything YAML or
JSON can hold (NaN, huge integers, unicode, lists where scalars belong), a key deleted or added, raw bytes
flipped (non-UTF-8, broken syntax). Runs in-process through CliRunner, a few seconds in all. CI draws the same
examples every run (derandomized); elsewhere each run explores new ones. QUALIFY_PROPERTY_EXAMPLES=1000 explores
more (the default keeps the whole file to a few seconds).
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from qualify.cli.app import app
from qualify.errors import QualifyError
from qualify.manifest import create_manifest, digest_of
from qualify.matrix import Matrix, load_matrix
from qualify.schema import from_dict, to_dict
from qualify.slurm.profile import load_profile
from tests.unit.matrix.test_loader import TINY

EXAMPLES = int(os.environ.get("QUALIFY_PROPERTY_EXAMPLES", "30"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=bool(os.environ.get("CI")),
                    suppress_health_check=[HealthCheck.too_slow])

ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from([0, -1, 1, 2, 3, 4, 7, 512, "fp32", "bf16", "torch-tp", "actor", "..",
                                           "../../escape", "1e-6", "a\nb", "\u00e9", ".nan", ""]),
    st.lists(st.integers(-3, 5), max_size=4), st.dictionaries(st.text(max_size=6), st.integers(-2, 2), max_size=3),
)


def paths_of(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a tree of dicts and lists, inner nodes included."""
    found = [prefix] if prefix else []
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, child in children:
        found += paths_of(child, (*prefix, key))
    return found


@st.composite
def mutated(draw: st.DrawFn, document: dict) -> dict:
    """document with 1 to 3 random edits: replace a value, delete a key or item, add an unknown key."""
    doc = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, 3))):
        paths = paths_of(doc)
        if not paths:
            break
        *parents, leaf = draw(st.sampled_from(paths))
        parent = doc
        for key in parents:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "replace":
            parent[leaf] = draw(ANY_VALUE)
        elif action == "delete":
            del parent[leaf]
        elif isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(ANY_VALUE)
        else:
            parent.append(draw(ANY_VALUE))
    return doc


@st.composite
def byte_edits(draw: st.DrawFn, text: bytes) -> bytes:
    """text with 1 to 4 random byte spans replaced (any bytes: invalid UTF-8, control characters, YAML syntax)."""
    data = bytearray(text)
    for _ in range(draw(st.integers(1, 4))):
        start = draw(st.integers(0, len(data)))
        end = draw(st.integers(start, min(len(data), start + 8)))
        data[start:end] = draw(st.binary(max_size=8) | st.sampled_from([b"&a ", b"*a", b"[", b"{", b": ", b"\n- "]))
    return bytes(data)


def invoke(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"traceback for {args}: {result.exception!r}")
    return result


def assert_one_line_error(result, path: Path) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("qualify: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert len(result.stderr) <= 1100 and str(path.name) in result.stderr, result.stderr


def check_matrix_outcome(path: Path) -> None:
    result = invoke("matrices", "validate", str(path))
    if result.exit_code == 0:  # accepted: it must be a matrix every later stage can use
        m = load_matrix(path)
        assert result.stdout.startswith(f"ok {path} ")
        assert from_dict(Matrix, to_dict(m), str(path)) == m
        names = [c.name for c in m.cases()]
        assert names and len(set(names)) == len(names)
        assert all(math.isfinite(v) for v in _floats(to_dict(m)))
        assert all(tp >= 1 and m.models.tiny is None or m.models.tiny.num_kv_heads % tp == 0
                   for tp in (*m.candidates.tp, *m.rollout.vllm_tp))
    else:
        assert_one_line_error(result, path)


def _floats(node: Any) -> list[float]:
    if isinstance(node, float):
        return [node]
    items = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
    return [f for item in items for f in _floats(item)]


@PROPERTY
@given(doc=mutated(TINY))
def test_mutated_matrices(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("m") / "m.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    check_matrix_outcome(path)


@PROPERTY
@given(text=byte_edits(yaml.safe_dump(TINY, sort_keys=False).encode()))
def test_byte_edited_matrices(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("m") / "m.yaml"
    path.write_bytes(text)
    check_matrix_outcome(path)


POSITIVE_INTS = ["models.tiny.hidden_size", "models.tiny.num_layers", "models.tiny.num_heads",
                 "models.tiny.num_kv_heads", "rollout.num_prompts", "rollout.prompt_len", "rollout.max_new_tokens"]
FINITE_FLOATS = ["rollout.temperature", "optimizer.lr", "optimizer.max_grad_norm", "freeze.k", "freeze.floors.grad",
                 "ppo.clip_eps", "models.tiny.initializer_range"]


@PROPERTY
@given(key=st.sampled_from(POSITIVE_INTS), value=st.integers(-(2**40), 0))
def test_a_count_below_one_is_refused_naming_the_key(tmp_path_factory, key, value):
    path = write_edit(tmp_path_factory, key, value)
    result = invoke("matrices", "validate", str(path))
    assert_one_line_error(result, path)
    assert key.rsplit(".", 1)[-1] in result.stderr


@PROPERTY
@given(key=st.sampled_from(FINITE_FLOATS), value=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_a_non_finite_number_is_refused_naming_the_key(tmp_path_factory, key, value):
    path = write_edit(tmp_path_factory, key, value)
    result = invoke("matrices", "validate", str(path))
    assert_one_line_error(result, path)
    assert key.rsplit(".", 1)[-1] in result.stderr and "finite" in result.stderr


@PROPERTY
@given(tp=st.lists(st.integers(-4, 6), min_size=0, max_size=4), vllm_tp=st.lists(st.integers(-4, 6), max_size=3))
def test_tp_degrees(tmp_path_factory, tp, vllm_tp):
    doc = copy.deepcopy(TINY)
    doc["candidates"]["tp"], doc["rollout"]["vllm_tp"] = tp, vllm_tp
    path = tmp_path_factory.mktemp("m") / "m.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = invoke("matrices", "validate", str(path))
    # the tiny family has 4 heads, 2 KV heads, MLP 128: the degrees that shard it evenly are 1 and 2
    valid = all(tp and len(set(tp)) == len(tp) and set(tp) <= {1, 2} for tp in (tp, vllm_tp))
    if valid:
        assert result.exit_code == 0, result.stderr
    else:
        assert_one_line_error(result, path)


def write_edit(tmp_path_factory, dotted: str, value: Any) -> Path:
    doc = copy.deepcopy(TINY)
    *parents, leaf = dotted.split(".")
    node = doc
    for key in parents:
        node = node[key]
    node[leaf] = value
    path = tmp_path_factory.mktemp("m") / "m.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def evidence(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("evidence")
    (root / "sub").mkdir()
    for name, data in {"a.json": b"{}\n", "sub/b.bin": bytes(range(256)), "c.txt": b"c"}.items():
        (root / name).write_bytes(data)
    document = create_manifest(root, root.parent / "base.manifest.json", progress=False)
    return root, document


@PROPERTY
@given(data=st.data())
def test_mutated_manifests(tmp_path_factory, evidence, data):
    root, document = evidence
    doc = data.draw(mutated(document))
    if data.draw(st.booleans()) and isinstance(doc, dict):
        try:  # half the time a consistent digest, so the checks behind the digest are reached too
            doc["digest"] = digest_of(doc)
        except (TypeError, ValueError):
            pass
    path = tmp_path_factory.mktemp("v") / "manifest.json"
    path.write_text(json.dumps(doc))
    result = invoke("verify", str(path), "--evidence", str(root), "--jobs", "1")
    if result.exit_code == 2:
        assert_one_line_error(result, path)
    else:
        assert result.exit_code in (0, 1), result.output


@PROPERTY
@given(data=st.data())
def test_byte_edited_manifests(tmp_path_factory, evidence, data):
    root, document = evidence
    text = data.draw(byte_edits(json.dumps(document, indent=2).encode()))
    path = tmp_path_factory.mktemp("v") / "manifest.json"
    path.write_bytes(text)
    result = invoke("verify", str(path), "--evidence", str(root), "--jobs", "1")
    assert result.exit_code in (0, 1, 2)
    if result.exit_code == 2:
        assert_one_line_error(result, path)


def test_the_unmutated_inputs_pass(tmp_path, evidence):
    root, document = evidence
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(document))
    assert invoke("verify", str(path), "--evidence", str(root)).exit_code == 0
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump(TINY))
    assert invoke("matrices", "validate", str(matrix)).exit_code == 0


def test_modified_evidence_is_exit_1_not_2(tmp_path, evidence):
    root, document = evidence
    copy_root = tmp_path / "evidence"
    for entry in document["files"]:
        target = copy_root / entry["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((root / entry["path"]).read_bytes())
    (copy_root / "c.txt").write_bytes(b"C")
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(document))
    assert invoke("verify", str(path), "--evidence", str(copy_root)).exit_code == 1


H100 = yaml.safe_load((Path(__file__).resolve().parents[2] / "sbatch/clusters/h100x4.yaml").read_text())


@PROPERTY
@given(doc=mutated(H100))
def test_mutated_cluster_profiles(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("p") / "p.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    try:
        profile = load_profile(path)
    except QualifyError as exc:
        assert str(exc).startswith(f"{path}: ") and "\n" not in str(exc), str(exc)
        return
    strings = [v for v in _strings(to_dict(profile)) if v is not profile.source]
    assert all(s.isascii() and s.isprintable() for s in strings), strings  # nothing can break a script line


def _strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    items = [*node.keys(), *node.values()] if isinstance(node, dict) else node if isinstance(node, list) else []
    return [s for item in items for s in _strings(item)]
