"""qualify.memory against hand-computed numbers, and `qualify sbatch` refusing at render time a stage whose memory
does not fit the profile's GPUs (negative controls: Qwen3-8B's reference on the device, its TP1/TP2 candidates on
80 GB GPUs; positive controls: the offloaded reference on 80 GB, megatron TP2 on B200s)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from qualify.errors import SlurmError
from qualify.matrix import load_matrix
from qualify.memory import (
    GiB,
    Shape,
    Workload,
    candidate_need,
    gpu_fits,
    matrix_shapes,
    misfits,
    reference_needs,
    shape_from_config,
)
from qualify.slurm.profile import load_profile
from qualify.slurm.render import render_chain

ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "tie_word_embeddings": False, "eos_token_id": 151645}
SMALL = Shape(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=32, lm_head=True)


def test_parameter_counts_by_hand():
    # one layer: q and o 64 x 128 each, k and v 64 x 64 each, MLP 3 x 64 x 128, two norms of 64, q/k norms of 32
    layer = 2 * 64 * 128 + 2 * 64 * 64 + 3 * 64 * 128 + 2 * 64 + 2 * 32
    assert SMALL.params == 2 * layer + 1000 * 64 + 1000 * 64 + 64
    assert dataclasses.replace(SMALL, tied=True).params == 2 * layer + 1000 * 64 + 64
    assert dataclasses.replace(SMALL, lm_head=False).params == 2 * layer + 1000 * 64 + (64 + 1) + 64
    # the published sizes: Qwen3-8B 8.19 B (untied), Qwen3-0.6B 0.596 B (tied)
    assert shape_from_config(QWEN3_8B, "actor").params == 8_190_735_360
    q06 = Shape(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                num_kv_heads=8, head_dim=128, lm_head=True, tied=True)
    assert q06.params == 596_049_920


def _matrix(tmp_path: Path, offload: str | None = "host", config: dict = QWEN3_8B) -> Path:
    data = yaml.safe_load((ROOT / "matrices/qwen3-8b.yaml").read_text())
    for role in ("actor", "critic", "reward"):
        (tmp_path / role).mkdir(exist_ok=True)
        (tmp_path / role / "config.json").write_text(json.dumps(config))
        data["models"]["checkpoints"][role] = str(tmp_path / role)
    data["models"]["checkpoints"]["reference"] = str(tmp_path / "actor")
    data["reference"].pop("offload", None)
    if offload:
        data["reference"]["offload"] = offload
    path = tmp_path / "qwen3-8b.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_reference_need_by_hand(tmp_path):
    m = load_matrix(_matrix(tmp_path, offload=None))
    shapes = matrix_shapes(m.models, m.resolve)
    p = 8_190_735_360
    tokens = 16 * (128 + 256)  # num_prompts x (prompt_len + max_new_tokens), one minibatch
    # checkpointing: one layer input a layer and token plus one layer's saved set, 5h + 6q + 4kv + 5i elements
    act = tokens * (36 * 4096 + 5 * 4096 + 6 * 4096 + 4 * 1024 + 5 * 12288)
    logits_bf16 = 2 * tokens * 151936 * 2 + 3 * 1024 * 151936 * 4
    need = {n.what: n for n in reference_needs(m.reference, Workload.of(m.rollout, m.ppo, m.reference), shapes)}
    bf16 = need["reference bf16 actor"]
    assert bf16.parts == {"state": 24 * p, "activations": 2 * act, "logits": logits_bf16}
    assert bf16.gpu_bytes == 24 * p + 2 * act + logits_bf16 and bf16.host_bytes == (16 + 4) * p
    plain = load_matrix(_matrix(tmp_path))
    work = Workload.of(plain.rollout, plain.ppo, plain.reference)
    offloaded = {n.what: n for n in reference_needs(plain.reference, work, shapes)}
    off = offloaded["reference bf16 actor (offload: host)"]
    assert off.parts["state"] == 4 * p and off.host_bytes == (16 + 20) * p
    assert offloaded["reference fp32 actor (offload: host)"].parts["state"] == 8 * p


def test_candidate_need_shards_all_but_the_replicated_parameters(tmp_path):
    m = load_matrix(_matrix(tmp_path))
    shapes = matrix_shapes(m.models, m.resolve)
    cases = {c.name: c for c in m.cases()}
    p = 8_190_735_360
    norms = 36 * (2 * 4096 + 2 * 128) + 4096
    embed = 151936 * 4096
    meg = candidate_need(Workload.of(m.rollout, m.ppo, m.reference), shapes, cases["megatron-bf16-tp2-actor"])
    ds = candidate_need(Workload.of(m.rollout, m.ppo, m.reference), shapes, cases["deepspeed-bf16-tp2-actor"])
    assert meg.parts["state"] == 20 * ((p - norms) // 2 + norms)
    assert ds.parts["state"] == 20 * ((p - norms - embed) // 2 + norms + embed)
    assert candidate_need(Workload.of(m.rollout, m.ppo, m.reference), shapes, cases["megatron-fp32-tp1-actor"]).parts["state"] == 16 * p


def test_fit_keeps_the_context_free():
    from qualify.memory import CONTEXT_BYTES, Need

    need = Need(what="x", gpu_bytes=10 * GiB, host_bytes=0)
    assert gpu_fits(need, 10 * GiB + CONTEXT_BYTES) and not gpu_fits(need, 10 * GiB + CONTEXT_BYTES - 1)


def test_sbatch_refuses_the_8b_reference_on_the_device_on_80gb_gpus(tmp_path):
    matrix = _matrix(tmp_path, offload=None)
    with pytest.raises(SlurmError) as err:
        render_chain(matrix, ROOT / "sbatch/clusters/h100x4.yaml", run=Path("runs/q"), out=tmp_path / "out",
                     cases="megatron-*-tp2-*")
    text = str(err.value)
    assert "reference bf16 actor needs 191.2 GiB a GPU" in text and "over the 79.6 GiB of one GPU" in text
    assert "with reference.offload: host it needs 38.7 GiB" in text


def test_sbatch_refuses_8b_candidates_that_do_not_fit_80gb_even_with_the_reference_offloaded(tmp_path):
    matrix = _matrix(tmp_path)
    with pytest.raises(SlurmError) as err:
        render_chain(matrix, ROOT / "sbatch/clusters/h100x4.yaml", run=Path("runs/q"), out=tmp_path / "out",
                     cases="megatron-bf16-tp2-actor")
    text = str(err.value)
    assert "1 stage(s)" in text and "case megatron-bf16-tp2-actor needs 104.3 GiB" in text
    assert "reference" not in text.split("case megatron")[0].split("cannot fit")[1]  # the reference fits now


def test_sbatch_renders_what_fits(tmp_path):
    # positive controls: the offloaded reference and megatron TP2 on 179 GiB B200s; the offloaded reference alone
    # (no case selected that needs more) on 80 GB H100s is checked through misfits directly
    chain = render_chain(_matrix(tmp_path), ROOT / "sbatch/clusters/b200x4.yaml", run=Path("runs/q"),
                         out=tmp_path / "out", cases="megatron-*-tp2-*")
    assert {j.key for j in chain.jobs} >= {"reference", "freeze", "candidate-2gpu"}
    m = load_matrix(_matrix(tmp_path))
    h100 = load_profile(ROOT / "sbatch/clusters/h100x4.yaml")
    lines, shapes = misfits(m, [], h100.gpu_mem_bytes, {"reference": 500 * GiB})
    assert shapes is not None and lines == []
    lines, _ = misfits(m, [], h100.gpu_mem_bytes, {"reference": 200 * GiB})  # host: 274.6 GiB needed
    assert len(lines) == 4 and "over the 200.0 GiB of host memory its job gets" in lines[0]


def test_nothing_is_checked_without_the_checkpoints_config_or_the_profiles_gpu_mem(tmp_path):
    m = load_matrix(ROOT / "matrices/qwen3-8b.yaml")  # /models/qwen3-8b is not on this machine
    assert misfits(m, m.cases(), 1, {}) == ([], None)
    profile = yaml.safe_load((ROOT / "sbatch/clusters/h100x4.yaml").read_text())
    profile.pop("gpu_mem")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(profile))
    render_chain(_matrix(tmp_path, offload=None), tmp_path / "p.yaml", run=Path("runs/q"), out=tmp_path / "out")


def test_a_moe_shape_counts_the_parameters_the_model_has():
    """Independent: the tiny MoE family built by transformers (actor MoE, critic dense); and a Qwen3-MoE config.json
    (Qwen3-30B-A3B's dimensions) has its experts counted, not a dense MLP of intermediate_size."""
    from qualify.matrix import TinyModel, TinyMoE
    from qualify.models.tiny import build_tiny_model

    class Models:
        tiny = TinyModel(seed=1, vocab_size=256, num_layers=2, moe=TinyMoE(num_experts=4, top_k=2,
                                                                             moe_intermediate_size=24))
        checkpoints = None

    shapes = matrix_shapes(Models, lambda p: Path(p))
    for role in ("actor", "critic"):
        model = build_tiny_model(Models.tiny, role)
        assert shapes[role].params == sum(p.numel() for p in model.parameters()), role
    assert shapes["actor"].num_experts == 4 and shapes["critic"].num_experts == 0
    config = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
              "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
              "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "tie_word_embeddings": False}
    shape = shape_from_config(config, "actor")
    assert 30.0e9 < shape.params < 31.0e9  # Qwen3-30B-A3B: 30.5B parameters
    with pytest.raises(SlurmError, match="mlp_only_layers"):
        shape_from_config(config | {"mlp_only_layers": [0]}, "actor")


def tiny_matrix_text(**sizes) -> str:
    text = (Path(__file__).resolve().parents[2] / "matrices" / "tiny-qwen3.yaml").read_text()
    for key, value in sizes.items():
        pattern = rf"^(    {key}:) .*$"
        text, found = re.subn(pattern, rf"\1 {value}", text, flags=re.MULTILINE)
        assert found == 1, key
    return text


@pytest.mark.parametrize("value, says", [
    ("1e30", "models.tiny.hidden_size: expected an integer, got '1e30'"),
    ("1.0e+30", "models.tiny.hidden_size: expected an integer, got 1e+30"),
    (str(10 ** 30), f"models.tiny: hidden_size {10 ** 30} is over 1048576"),
    ("-5", "models.tiny: hidden_size must be >= 1"),
])
def test_an_absurd_model_size_is_refused_in_one_line_naming_the_field(tmp_path, value, says):
    """hidden_size: 1e30 (written as a float or as an integer) is refused when the matrix is loaded, by every
    command (`matrices validate`, `reference`), naming the field; it was a crash in torch."""
    from typer.testing import CliRunner

    from qualify.cli.app import app

    path = tmp_path / "m.yaml"
    path.write_text(tiny_matrix_text(hidden_size=value))
    for command in (["matrices", "validate", str(path)], ["reference", str(path), "--run", str(tmp_path / "run")]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2 and says in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_merely_huge_family_is_refused_by_its_memory_estimate(tmp_path):
    """Sizes each within bounds whose four fp32 models exceed this machine's memory (about 48 TB here): refused by
    `matrices validate` and by the reference before a weight is drawn, naming the field that weighs most."""
    from typer.testing import CliRunner

    from qualify.cli.app import app
    from qualify.errors import MatrixError
    from qualify.matrix import load_matrix
    from qualify.memory import host_memory_bytes, tiny_family_problem
    from qualify.models.tiny import make_tiny_family

    path = tmp_path / "m.yaml"
    path.write_text(tiny_matrix_text(hidden_size=1_000_000, intermediate_size=1_000_000))
    tiny = load_matrix(path).models.tiny  # each size within its bound
    problem = tiny_family_problem(tiny, host_memory_bytes())
    assert problem.startswith("models.tiny.hidden_size 1000000: the tiny family's four models hold ")
    assert "GiB in fp32, over the " in problem and "GiB of this machine's memory" in problem
    result = CliRunner().invoke(app, ["matrices", "validate", str(path)])
    assert result.exit_code == 2 and f"{path}: {problem}" in result.stderr, result.stderr
    with pytest.raises(MatrixError, match="models.tiny.hidden_size 1000000"):
        make_tiny_family(tiny, tmp_path / "models")
    assert not (tmp_path / "models").exists()
    assert tiny_family_problem(load_matrix(path.parent / "m.yaml").models.tiny, 1 << 62) is None  # a host that holds it
