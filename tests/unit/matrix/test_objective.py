"""GRPO and DP in matrices: algorithm and the grpo section validate strictly with errors naming the key and the
numbers; DP case names, world sizes and max_ranks; capture requests group_size responses per prompt, each with its
own seed; a PPO DP1 spec reads as before (its resume key unchanged)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from qualify.errors import MatrixError
from qualify.matrix import Case, load_matrix

MATRICES = Path(__file__).resolve().parents[3] / "matrices"
GRPO = yaml.safe_load((MATRICES / "tiny-qwen3-grpo.yaml").read_text())
PPO = yaml.safe_load((MATRICES / "tiny-qwen3.yaml").read_text())


def load(tmp_path: Path, data: dict[str, Any]):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_matrix(path)


def error(tmp_path: Path, data: dict[str, Any]) -> str:
    with pytest.raises(MatrixError) as info:
        load(tmp_path, data)
    return str(info.value)


def edit(base: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(base)
    for section, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return data


def test_shipped_grpo_matrix():
    m = load_matrix(MATRICES / "tiny-qwen3-grpo.yaml")
    assert m.algorithm == "grpo" and m.roles == ("actor",) and m.num_rows == 20
    names = [c.name for c in m.cases()]
    assert names == [f"{e}-{p}-{d}-actor" for e in ("torch-tp", "deepspeed") for p in ("fp32", "bf16")
                     for d in ("tp1", "tp1-dp2", "tp2")]


def test_ppo_default_is_unchanged():
    m = load_matrix(MATRICES / "tiny-qwen3.yaml")
    assert m.algorithm == "ppo" and m.grpo is None and m.roles == ("actor", "critic") and m.num_rows == 8
    assert all(c.dp == 1 and "dp" not in c.name for c in m.cases())


@pytest.mark.parametrize(("data", "expected"), [
    (edit(GRPO, algorithm="ppo"), "grpo section is required with algorithm: grpo and refused otherwise"),
    ({k: v for k, v in GRPO.items() if k != "grpo"}, "grpo section is required"),
    (edit(GRPO, algorithm="a2c"), "algorithm"),
    (edit(GRPO, candidates={"roles": ["actor", "critic"]}), "GRPO has no critic: write roles: [actor]"),
    (edit(GRPO, freeze={"require": ["value_clip"]}), "freeze.require lists value_clip"),
    (edit(GRPO, grpo={"group_size": 1}), "group_size must be >= 2"),
    (edit(GRPO, grpo={"aggregation": "seq_mean_token_sum_norm"}), "constant is required"),
    (edit(GRPO, grpo={"constant": 16.0}), "constant is required with aggregation 'seq_mean_token_sum_norm' and only"),
    (edit(GRPO, grpo={"aggregation": "seq_mean_token_sum_norm", "constant": -1.0}), "constant must be > 0"),
    (edit(GRPO, grpo={"kl_estimator": "k4"}), "kl_estimator"),
    (edit(GRPO, grpo={"aggregation": "sum"}), "aggregation"),
    (edit(GRPO, grpo={"kl_coef": -0.1}), "kl_coef must be >= 0"),
    (edit(GRPO, ppo={"minibatches": 3}), ("ppo.minibatches 3 must split the 20 rows (rollout.num_prompts 5 x "
                                         "grpo.group_size 4)")),
    (edit(GRPO, ppo={"minibatches": 10}), "into equal minibatches of whole groups"),
    (edit(GRPO, candidates={"dp": [1, 3]}), "candidates.dp 3 does not divide the 20 rows of an optimizer step"),
    (edit(GRPO, candidates={"determinism": {"megatron": "bitwise"}}), ("determinism names ['megatron'], which are "
                                                                      "not among engines ['torch-tp', 'deepspeed']")),
    (edit(GRPO, candidates={"determinism": {"torch-tp": "exact"}}), ("determinism must be 'bitwise' or 'bounded' per "
                                                                    "engine, got torch-tp: 'exact'")),
    (edit(GRPO, candidates={"dp": [0]}), "dp must list degrees >= 1"),
    (edit(GRPO, candidates={"dp": [2, 2]}), "dp lists [2] more than once"),
    (edit(GRPO, candidates={"max_ranks": 0}), "max_ranks 0 leaves no case"),
    (edit(PPO, candidates={"dp": [1, 3]}), "candidates.dp 3 does not divide the 8 rows of an optimizer step"),
    (edit(PPO, ppo={"minibatches": 2}, candidates={"dp": [8]}), ("candidates.dp 8 does not divide the 4 rows of an "
                                                                 "optimizer step (8 rows / ppo.minibatches 2)")),
    (edit(GRPO, candidates={"vocab_tile": 0}), "vocab_tile must be >= 1 or null"),
    (edit(GRPO, candidates={"vocab_tile": 48}), ("candidates.vocab_tile 48 x candidates.tp 1 does not divide "
                                                 "models.tiny vocab_size 512")),
    (edit(GRPO, candidates={"vocab_tile": 64, "logprob_formula": "processed"}), "computes the full formula only"),
    (edit(PPO, grpo={"group_size": 2}), "refused otherwise (algorithm is 'ppo')"),
])
def test_invalid_grpo_and_dp_settings_name_the_problem(tmp_path, data, expected):
    assert expected in error(tmp_path, data)


def test_ppo_runs_actor_and_critic_at_dp2(tmp_path):
    m = load(tmp_path, edit(PPO, candidates={"engines": ["torch-tp"], "precisions": ["fp32"], "tp": [1],
                                             "dp": [1, 2]}))
    assert [c.name for c in m.cases()] == ["torch-tp-fp32-tp1-actor", "torch-tp-fp32-tp1-critic",
                                           "torch-tp-fp32-tp1-dp2-actor", "torch-tp-fp32-tp1-dp2-critic"]


def test_dr_grpo_and_population_std_load(tmp_path):
    m = load(tmp_path, edit(GRPO, grpo={"aggregation": "seq_mean_token_sum_norm", "constant": 16.0,
                                        "scale_std": False, "std_estimator": "population"}))
    assert m.grpo.constant == 16.0 and not m.grpo.scale_std


def test_case_names_carry_dp_only_above_one():
    assert Case(engine="torch-tp", precision="fp32", tp=1, role="actor").name == "torch-tp-fp32-tp1-actor"
    case = Case(engine="torch-tp", precision="bf16", tp=2, role="actor", dp=2)
    assert case.name == "torch-tp-bf16-tp2-dp2-actor" and case.world_size == 4


def test_max_ranks_leaves_out_larger_cases(tmp_path):
    full = load(tmp_path, edit(GRPO, candidates={"max_ranks": None}))
    assert {(c.tp, c.dp) for c in full.cases()} == {(1, 1), (1, 2), (2, 1), (2, 2)}


def test_capture_requests_group_size_responses_per_prompt_each_with_its_own_seed(tmp_path):
    from qualify.rollout.capture import capture_request

    m = load_matrix(MATRICES / "tiny-qwen3-grpo.yaml")
    model = tmp_path / "model"
    model.mkdir()
    request = capture_request(m.capture, model, 1, vocab_size=512, eos_token_id=None)
    prompts, seeds, g = request["prompts"], request["seeds"], m.grpo.group_size
    assert len(prompts) == m.num_rows == len(seeds) == len(set(seeds))
    assert seeds == [m.rollout.seed + i for i in range(m.num_rows)]
    for start in range(0, m.num_rows, g):  # a group: one prompt, g times, contiguous
        assert all(p == prompts[start] for p in prompts[start:start + g])
    assert len({tuple(p) for p in prompts}) == m.rollout.num_prompts


def test_spec_of_a_ppo_dp1_case_reads_as_before(tmp_path):
    from qualify.case.spec import make_spec, read_spec

    m = load_matrix(MATRICES / "tiny-qwen3.yaml")
    kw = {k: tmp_path for k in ("model_dir", "rollout_dir", "targets_dir", "case_dir")}
    spec = make_spec(m.case_settings, m.cases()[0], rollout_digest="r", targets_digest="t", vocab_size=512, device="cpu", **kw)
    assert "grpo" not in spec.to_json() and "dp" not in spec.to_json()  # the PPO resume key is what it was
    g = load_matrix(MATRICES / "tiny-qwen3-grpo.yaml")
    case = next(c for c in g.cases() if c.dp == 2)
    gspec = make_spec(g.case_settings, case, rollout_digest="r", targets_digest="t", vocab_size=512, device="cpu", **kw)
    assert gspec.to_json()["dp"] == 2 and gspec.to_json()["grpo"]["group_size"] == 4
    (tmp_path / "spec.json").write_text(__import__("json").dumps(gspec.to_json()))
    assert read_spec(tmp_path / "spec.json") == gspec
