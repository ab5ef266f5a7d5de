"""Matrix loading: shipped matrices load; unknown keys, wrong types, missing fields and invalid values are
MatrixErrors that name the file and the key; cases enumerate as the full product."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from qualify.errors import MatrixError
from qualify.matrix import Matrix, load_matrix, matrix_files
from qualify.schema import from_dict, to_dict

MATRICES = Path(__file__).resolve().parents[3] / "matrices"
SHIPPED = sorted(MATRICES.glob("*.yaml"))
TINY = yaml.safe_load((MATRICES / "tiny-qwen3.yaml").read_text())


def test_matrices_are_shipped():
    assert {p.name for p in SHIPPED} >= {"tiny-qwen3.yaml", "tiny-qwen3-pad.yaml", "qwen3-8b.yaml"}
    assert matrix_files(MATRICES) == SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_matrix_loads(path):
    m = load_matrix(path)
    assert m.name == path.stem and m.source == str(path) and m.description
    c = m.candidates
    degrees = sum(t * d <= (c.max_ranks or t * d) for t in c.tp for d in c.dp)  # (tp, dp) pairs within max_ranks
    assert len(m.cases()) == len(c.engines) * len(c.precisions) * degrees * len(c.packing) * len(c.roles) > 0
    assert from_dict(Matrix, to_dict(m), str(path)) == m  # plain data round-trips


def write(tmp_path: Path, data: Any, name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def edited(edit: Callable[[dict], None]) -> dict:
    data = copy.deepcopy(TINY)
    edit(data)
    return data


def setter(dotted: str, value: Any) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        *parents, leaf = dotted.split(".")
        for key in parents:
            data = data[key]
        data[leaf] = value
    return edit


def deleter(dotted: str) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        *parents, leaf = dotted.split(".")
        for key in parents:
            data = data[key]
        del data[leaf]
    return edit


def load_error(tmp_path: Path, data: Any) -> str:
    path = write(tmp_path, data)
    with pytest.raises(MatrixError) as info:
        load_matrix(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message  # every error names the file first
    assert "\n" not in message.strip()
    return message


@pytest.mark.parametrize("edits, branch, wake", [
    ({"ppo.epochs": 1, "ppo.minibatches": 1}, "adam_past_first_step", "set ppo.epochs x ppo.minibatches >= 2"),
    ({"optimizer.max_grad_norm": 0.0}, "grad_clip", "lower optimizer.max_grad_norm"),
    ({"rollout.max_new_tokens": 1}, "padded_rows", "let responses end at different lengths"),
])
def test_a_required_branch_no_reference_can_take_is_refused_at_load(tmp_path, edits, branch, wake):
    data = copy.deepcopy(TINY)
    data["freeze"]["require"] = [branch]
    for dotted, value in edits.items():
        setter(dotted, value)(data)
    message = load_error(tmp_path, data)
    assert f"freeze.require lists {branch}, which no reference of this matrix can exercise: {wake}" in message
    data["freeze"]["require"] = []  # the same settings without the requirement load
    assert load_matrix(write(tmp_path, data, "ok.yaml")).freeze.require == ()


def test_missing_here_names_absent_checkpoints_and_prompts(tmp_path):
    assert load_matrix(MATRICES / "tiny-qwen3.yaml").missing_here() == []
    assert load_matrix(MATRICES / "tiny-qwen3-pad.yaml").missing_here() == []  # its prompts file is shipped
    gpu = load_matrix(MATRICES / "qwen3-8b.yaml").missing_here()
    assert gpu[0] == "models.checkpoints.actor /models/qwen3-8b/actor (no config.json there)" and len(gpu) == 4
    data = copy.deepcopy(TINY)
    data["rollout"]["prompts_file"] = "nowhere.json"
    assert load_matrix(write(tmp_path, data)).missing_here() == ["rollout.prompts_file nowhere.json (not a file)"]


def test_unedited_copy_loads(tmp_path):
    assert load_matrix(write(tmp_path, TINY)).name == "tiny-qwen3"


@pytest.mark.parametrize("dotted", [
    "bogus", "models.tiny.bogus", "models.bogus", "rollout.bogus", "ppo.bogus", "optimizer.bogus",
    "reference.bogus", "freeze.bogus", "candidates.bogus",
])
def test_unknown_key_names_the_key_and_file(tmp_path, dotted):
    message = load_error(tmp_path, edited(setter(dotted, 1)))
    assert f"unknown key '{dotted}'" in message
    assert "allowed:" in message


def test_unknown_key_under_a_section_that_defaults(tmp_path):
    message = load_error(tmp_path, edited(setter("optimizer", {"lr": 1.0e-3, "momentum": 0.9})))
    assert "unknown key 'optimizer.momentum'" in message


@pytest.mark.parametrize("dotted, value, expected", [
    ("rollout.num_prompts", "8", "expected an integer, got '8'"),
    ("rollout.num_prompts", True, "expected an integer, got True"),
    ("rollout.num_prompts", 8.0, "expected an integer, got 8.0"),
    ("models.tiny.seed", "x", "expected an integer"),
    ("rollout.vllm_tp", 2, "expected a list, got 2"),
    ("rollout.vllm_tp", "1,2", "expected a list"),
    ("rollout.vllm_tp", [1, "2"], "rollout.vllm_tp[1]: expected an integer"),
    ("rollout.temperature", True, "expected a number, got True"),
    ("optimizer.lr", "1e-3", "write 1.0e-6, not 1e-6"),
    ("optimizer.betas", [0.9], "expected 2 items, got 1"),
    ("reference.gradient_checkpointing", "yes", "expected bool"),
    ("reference.precisions", ["fp32", "fp16"], "reference.precisions[1]: expected one of 'fp32' | 'bf16'"),
    ("candidates.roles", ["actor", 1], "candidates.roles[1]: expected one of 'actor' | 'critic', got 1"),
    ("freeze.floors", [1.0], "freeze.floors: expected a mapping"),
    ("freeze.floors.grad", "small", "freeze.floors.grad: expected a number"),
    ("rollout.eos_token_id", "2", "rollout.eos_token_id: expected an integer, got '2'"),
    ("models.tiny", 5, "models.tiny: expected a mapping, got 5"),
    ("name", 3, "name: expected str, got 3"),
])
def test_wrong_type_names_key_and_expectation(tmp_path, dotted, value, expected):
    message = load_error(tmp_path, edited(setter(dotted, value)))
    assert expected in message
    assert dotted.split(".")[0] in message


@pytest.mark.parametrize("dotted", ["rollout.num_prompts", "models.tiny.vocab_size", "candidates.engines",
                                    "candidates", "freeze", "name"])
def test_missing_field_names_the_key(tmp_path, dotted):
    assert f"missing field '{dotted}'" in load_error(tmp_path, edited(deleter(dotted)))


@pytest.mark.parametrize("dotted, value, expected", [
    ("reference.repeats", 1, "reference: repeats must be >= 2"),
    ("models.tiny.head_dim", 16, "models.tiny: head_dim 16 < 32"),
    ("models.tiny.num_kv_heads", 3, "not a multiple of num_kv_heads"),
    ("freeze.floors.bogus", 1.0, "unknown floor kinds ['bogus']"),
    ("freeze.k", 0.5, "k must be >= 1"),
    ("rollout.temperature", 0.0, "temperature must be > 0"),
    ("rollout.top_p", 1.5, "top_p must be in (0, 1]"),
    ("rollout.vllm_tp", [], "vllm_tp must list degrees >= 1"),
    ("rollout.max_new_tokens", 10_000, "exceeds max_model_len"),
    ("ppo.token_normalizer", "constant", "normalizer_constant is required"),
    ("reference.precisions", ["fp32"], "top level: reference.precisions must be [fp32, bf16]"),
])
def test_validation_error_is_a_matrix_error_naming_the_file(tmp_path, dotted, value, expected):
    assert expected in load_error(tmp_path, edited(setter(dotted, value)))


def test_missing_floor_kind(tmp_path):
    assert "floors missing for ['update']" in load_error(tmp_path, edited(deleter("freeze.floors.update")))
    # a matrix written for the moment bounds of earlier versions is told why that floor is gone
    assert "moments are no longer judged against a bound" in load_error(
        tmp_path, edited(setter("freeze.floors.moment", 0.0)))


def test_models_needs_exactly_one_source(tmp_path):
    both = edited(setter("models.checkpoints", {"actor": "a", "reference": "r", "critic": "c", "reward": "w"}))
    assert "set exactly one of 'tiny' or 'checkpoints'" in load_error(tmp_path, both)
    assert "set exactly one" in load_error(tmp_path, edited(setter("models", {})))


@pytest.mark.parametrize("text, expected", [
    ("", "top level: expected a mapping, got None"),
    ("- 1\n- 2\n", "top level: expected a mapping"),
    ("name: [unclosed\n", "not valid YAML"),
])
def test_not_a_matrix(tmp_path, text, expected):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(MatrixError, match=str(path)) as info:
        load_matrix(path)
    assert expected in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(MatrixError, match="matrix file not found"):
        load_matrix(tmp_path / "absent.yaml")


def test_defaults_fill_in(tmp_path):
    data = edited(deleter("ppo"))
    del data["optimizer"], data["reference"], data["rollout"]["top_k"]
    data["freeze"]["require"] = ["padded_rows"]  # Adam past step 1 needs more than the default single step
    m = load_matrix(write(tmp_path, data))
    assert m.ppo.clip_eps == 0.2 and m.optimizer.betas == (0.9, 0.999) and m.reference.repeats == 2
    assert m.rollout.top_k == -1 and m.rollout.eos_token_id is None and m.candidates.topologies == ("dedicated",)
    assert isinstance(m.optimizer.lr, float)


def test_integers_are_accepted_where_floats_are_expected(tmp_path):
    m = load_matrix(write(tmp_path, edited(setter("freeze.k", 4))))
    assert m.freeze.k == 4.0 and isinstance(m.freeze.k, float)


def test_cases_enumerate_the_full_product(tmp_path):
    data = edited(setter("candidates", {"engines": ["torch-tp", "my.pkg:factory"], "precisions": ["bf16"],
                                         "tp": [1, 2, 4], "roles": ["critic", "actor"]}))
    data["models"]["tiny"] |= {"num_heads": 8, "num_kv_heads": 4}  # TP4 must divide the heads
    cases = load_matrix(write(tmp_path, data)).cases()
    expected = []
    for engine in ("torch-tp", "my.pkg:factory"):  # the obvious loop, engine outermost
        for tp in (1, 2, 4):
            for role in ("critic", "actor"):
                expected.append((engine, "bf16", tp, role))
    assert [(c.engine, c.precision, c.tp, c.role) for c in cases] == expected
    assert cases[0].name == "torch-tp-bf16-tp1-critic"
    assert cases[-1].name == "my-pkg-factory-bf16-tp4-actor"
    assert len({c.name for c in cases}) == len(cases)


def test_shipped_tiny_cases():
    names = [c.name for c in load_matrix(MATRICES / "tiny-qwen3.yaml").cases()]
    assert len(names) == 16
    assert names[:3] == ["torch-tp-fp32-tp1-actor", "torch-tp-fp32-tp1-critic", "torch-tp-fp32-tp2-actor"]
    assert names[-1] == "deepspeed-bf16-tp2-critic"


def test_resolve_is_relative_to_the_matrix_file(tmp_path):
    m = load_matrix(write(tmp_path, TINY))
    assert m.resolve("prompts.json") == tmp_path / "prompts.json"
    assert m.resolve("/abs/p.json") == Path("/abs/p.json")
