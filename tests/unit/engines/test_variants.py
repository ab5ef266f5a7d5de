"""Engine variants (DeepSpeed's ZeRO stages, Megatron's distributed optimizer): their names, the configs they build,
and the completeness check of the sharded state they export. The engines themselves run in
tests/integration/test_deepspeed_engine.py, test_grpo_chain.py and (on a GPU) test_megatron_distopt.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import yaml

from qualify.case.context import EngineContext
from qualify.engines.deepspeed_engine import DeepSpeedEngine, ds_config
from qualify.engines.registry import ENGINES, get_engine, preload_modules
from qualify.engines.shard_coverage import complete_state, coverage_problem
from qualify.errors import EngineError
from qualify.matrix import BUILTIN_ENGINES, DEEPSPEED_ENGINES, MEGATRON_ENGINES, Case, Optimizer, load_matrix
from qualify.report_verify import CASE_NAME

ROOT = Path(__file__).resolve().parents[3]


def context(precision: str = "bf16", tp: int = 1, dp: int = 1) -> EngineContext:
    return EngineContext(role="actor", precision=precision, tp=tp, rank=0, device="cpu", model_dir=Path("m"),
                         optimizer=Optimizer(max_grad_norm=0.5), temperature=1.0, logprob_chunk_tokens=32,
                         vocab_size=512, work_dir=Path("w"), dp=dp)


def test_every_variant_is_a_registered_builtin():
    assert set(DEEPSPEED_ENGINES) | set(MEGATRON_ENGINES) <= set(BUILTIN_ENGINES) == set(ENGINES)
    for stage, name in enumerate(DEEPSPEED_ENGINES):
        engine = get_engine(name)
        assert isinstance(engine, DeepSpeedEngine) and (engine.zero_stage, engine.name) == (stage, name)
        assert preload_modules(name) == ("deepspeed",)  # the CPU fork server imports deepspeed before it forks
    distopt = get_engine("megatron-distopt")
    assert distopt.distributed_optimizer and distopt.name == "megatron-distopt"
    assert not get_engine("megatron").distributed_optimizer and preload_modules("megatron-distopt") == ()


def test_a_zero_stage_that_does_not_exist_is_refused():
    with pytest.raises(EngineError, match=r"^deepspeed: ZeRO stage 4 does not exist \(0 to 3\)$"):
        DeepSpeedEngine(zero_stage=4)


@pytest.mark.parametrize("engine", DEEPSPEED_ENGINES[1:] + ("megatron-distopt",))
def test_variant_case_names_parse_back(engine):
    name = Case(engine=engine, precision="bf16", tp=1, role="actor", dp=2).name
    assert name == f"{engine}-bf16-tp1-dp2-actor"
    parts = CASE_NAME.match(name)
    assert (parts["engine"], parts["precision"], parts["tp"], parts["dp"], parts["role"]) == (
        engine, "bf16", "1", "2", "actor")


def test_zero0_config_is_unchanged_by_the_stages():
    config = ds_config(context(), 0.5)
    assert config["zero_optimization"] == {"stage": 0} and config["gradient_clipping"] == 0.5
    assert "data_types" not in config and "communication_data_type" not in config  # stage 0 refuses fp32 accumulation


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_stage_configs(stage, precision):
    config = ds_config(context(precision), 0.5, zero_stage=stage)
    zero = config["zero_optimization"]
    assert zero["stage"] == stage and config["gradient_clipping"] == 0.5
    assert config["communication_data_type"] == "fp32"  # DeepSpeed's default under bf16 reduces in bf16
    assert config.get("data_types") == ({"grad_accum_dtype": "fp32"} if precision == "bf16" else None)
    # stage 3 partitions every parameter (its default keeps those under 1e5 elements, all of the tiny model, whole)
    assert zero.get("stage3_param_persistence_threshold") == (0 if stage == 3 else None)
    assert ds_config(context(precision), None, zero_stage=stage).get("gradient_clipping") is None


@pytest.mark.parametrize(("fragments", "numel", "problem"), [
    ([(0, 4), (4, 6)], 10, None),
    ([(4, 6), (0, 0), (0, 4)], 10, None),  # any order; a rank holding nothing
    ([(0, 10)], 10, None),
    ([(0, 4), (5, 5)], 10, "elements [4, 5) are held by no rank"),
    ([(0, 4), (3, 7)], 10, "elements [3, 4) are held by two ranks"),
    ([(0, 4), (4, 4)], 10, "elements [8, 10) are held by no rank"),
    ([(0, 4), (4, 7)], 10, "the fragments reach element 11 of 10"),
    ([], 3, "elements [0, 3) are held by no rank"),
    ([(0, 4), (0, 4), (4, 6)], 10, "elements [0, 4) are held by two ranks"),
])
def test_coverage_of_the_ranks_fragments(fragments, numel, problem):
    assert coverage_problem(fragments, numel) == problem


def test_state_of_an_incomplete_or_misshapen_parameter_is_left_out():
    """A parameter named incomplete, or whose gathered state of any key is not its full shape (one rank's fragment
    read as the whole, say), loses its state under every key: the case's evidence/optimizer_state row names it."""
    shapes = {"a": (2, 3), "b": (4,), "c": (5,)}
    state = {"exp_avg": {"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(5)},
             "exp_avg_sq": {"a": torch.zeros(2, 3), "b": torch.zeros(2), "c": torch.zeros(5)}}
    kept, why = complete_state(state, shapes, {"c": "elements [3, 5) are held by no rank"})
    assert {key: sorted(by_name) for key, by_name in kept.items()} == {"exp_avg": ["a"], "exp_avg_sq": ["a"]}
    assert why == {"b": "its gathered exp_avg_sq has shape (2,), the parameter (4,)",
                   "c": "elements [3, 5) are held by no rank"}
    assert complete_state(state | {"exp_avg_sq": state["exp_avg"]}, shapes, {})[1] == {}


def _moe_matrix(tmp_path, engines, tp):
    data = yaml.safe_load((ROOT / "matrices" / "tiny-qwen3-moe.yaml").read_text())
    data["candidates"].update(engines=engines, tp=tp)
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_matrix(path)


def test_the_distributed_optimizer_inherits_megatrons_moe_limit(tmp_path):
    assert _moe_matrix(tmp_path, ["torch-tp", "megatron-distopt"], [1]).candidates.engines[-1] == "megatron-distopt"
    with pytest.raises(ValueError, match=r": candidates.engines lists megatron-distopt beside the MoE family .* at TP 1 only"):
        _moe_matrix(tmp_path, ["torch-tp", "megatron-distopt"], [1, 2])


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
@pytest.mark.parametrize("distributed", [False, True])
def test_megatron_configs(distributed):
    """What megatron-core is told, built on the CPU (its DDP and optimizer need CUDA; the GPU test runs them)."""
    import transformers

    from qualify.engines.megatron import VOCAB_DIVISIBLE_BY, ddp_config, optimizer_config, transformer_config
    from qualify.engines.megatron_convert import Qwen3Layout

    hf = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=32, intermediate_size=128, vocab_size=512)
    ctx = context(dp=2)
    config = transformer_config(hf, Qwen3Layout.from_hf_config(hf, "actor", VOCAB_DIVISIBLE_BY), ctx)
    assert config.calculate_per_token_loss  # DDP sums the DP ranks' gradients: each rank's loss is its share
    ddp = ddp_config(distributed)
    assert ddp.use_distributed_optimizer is distributed and not ddp.average_in_collective
    assert ddp.grad_reduce_in_fp32 and not ddp.overlap_grad_reduce and not ddp.overlap_param_gather
    opt = optimizer_config(ctx, distributed)
    assert opt.use_distributed_optimizer is distributed and opt.clip_grad == 0.5 and opt.bf16
