"""qualify diagnose on real engines at TP2: a fault injected in one layer is localized to that layer and module, for
two different layers and two kinds of fault; a correct engine (torch-tp) has every layer within bound.

The reference (with its per-layer activations) and its acceptance (with layer bounds) come from the session's
frozen run; the cases are real torchrun launches of the plugin engines in tests/integration/plugins.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from qualify.candidate.stage import run_candidates
from qualify.diagnose.stage import diagnose
from tests.integration._support import matrix_with, plugins_importable  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.engines
vllm = pytest.mark.vllm  # the session's frozen run (as every test that uses it is marked)
P = "tests.integration.plugins"
FAULTS = {  # plugin -> (layer, module whose output must be the first out of bound)
    "attention_scale_layer0": ("0", "act/model.layers.0.self_attn"),
    "attention_scale_layer1": ("1", "act/model.layers.1.self_attn"),
    "norm_weight_layer1": ("1", "act/model.layers.1.post_attention_layernorm"),
}
CORRECT = "torch-tp-fp32-tp2-actor"


def case_of(plugin: str) -> str:
    return f"tests-integration-plugins-{plugin}-fp32-tp2-actor"


@pytest.fixture(scope="module")
def diagnosed(frozen_run, tmp_path_factory):
    """A copy of the frozen run with the faulty cases and the correct one run at TP2, each diagnosed."""
    import os

    from tests.integration._support import REPO

    run = tmp_path_factory.mktemp("diagnose") / "run"
    shutil.copytree(frozen_run / "reference", run / "reference")
    shutil.copytree(frozen_run / "acceptance", run / "acceptance")
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), old]))  # module scope: no monkeypatch
    try:
        # TP2 only: the frozen reference's tp_split control needs a candidate TP degree above 1
        run_candidates(matrix_with(run.parent, engines=["torch-tp", *(f"{P}:{p}" for p in FAULTS)],
                                   precisions=["fp32"], tp=[2], roles=["actor"]), run)
        docs = {case: diagnose(run, case) for case in [*map(case_of, FAULTS), CORRECT]}
    finally:
        os.environ.pop("PYTHONPATH") if old is None else os.environ.update(PYTHONPATH=old)
    return run, docs


@vllm
def test_the_acceptance_holds_layer_bounds(frozen_run):
    doc = json.loads((frozen_run / "acceptance" / "acceptance.json").read_text())
    assert set(doc["layer_bounds"]) == {"actor.json", "critic.json"}


@vllm
@pytest.mark.parametrize("plugin", sorted(FAULTS))
def test_fault_in_one_layer_is_localized_to_it(diagnosed, plugin):
    _, docs = diagnosed
    doc = docs[case_of(plugin)]
    layer, key = FAULTS[plugin]
    first = doc["first_departure"]
    assert not doc["passed"] and doc["layer_outputs_hook"]
    assert (first["layer"], first["key"], first["phase"], first["family"]) == (layer, key, "forward", "fp32-repeat")
    assert float(first["ratio"]) > 10  # far out, not at the edge
    rows = doc["families"]["fp32-repeat"]["rows"]
    before = rows[:next(i for i, r in enumerate(rows) if r["key"] == key)]
    assert before and all(r["passed"] for r in before)  # every module before the faulty one is within bound


@vllm
def test_correct_engine_has_every_layer_within_bound(diagnosed):
    _, docs = diagnosed
    doc = docs[CORRECT]
    fam = doc["families"]["fp32-repeat"]
    assert doc["passed"] and doc["first_departure"] is None and fam["passed"]
    keys = {r["key"] for r in fam["rows"]}
    assert {"act/model.layers.0", "act/model.layers.1", "act/model.norm", "grads/model.layers.0",
            "grads/model.layers.1"} <= keys
    assert all(r["passed"] and float(r["ratio"]) < 1 for r in fam["rows"])
    assert float(fam["closest"]["ratio"]) == max(float(r["ratio"]) for r in fam["rows"])


@vllm
def test_cli_exit_codes_text_and_out(diagnosed, tmp_path):
    from qualify.cli.app import app

    run, _ = diagnosed
    out = tmp_path / "d.json"
    bad = CliRunner().invoke(app, ["diagnose", str(run), "--case", case_of("norm_weight_layer1"), "--out", str(out)])
    assert bad.exit_code == 1, bad.output
    assert "first departure: layer 1, act/model.layers.1.post_attention_layernorm (forward)" in bad.output
    assert json.loads(out.read_text())["first_departure"]["layer"] == "1"
    good = CliRunner().invoke(app, ["diagnose", str(run), "--case", CORRECT, "--format", "json"])
    assert good.exit_code == 0, good.output
    assert json.loads(good.stdout)["passed"] is True


@vllm
def test_html_report_plots_the_diagnoses(diagnosed, tmp_path):
    from qualify.cli.app import app

    run, _ = diagnosed
    out = tmp_path / "r.html"
    CliRunner().invoke(app, ["report", str(run), "--format", "html", "--out", str(out)])
    html = out.read_text()
    assert f'data-case="{case_of("attention_scale_layer0")}"' in html and f'data-case="{CORRECT}"' in html
    assert "first out of bound: layer 0, act/model.layers.0.self_attn" in html


@pytest.mark.gpu
def test_megatron_layer_outputs_are_the_hf_modules_outputs(tiny_matrix, tmp_path, monkeypatch):
    """megatron-core's layers hooked under HF names hold what the HF modules compute (fp32, TP1, one GPU)."""
    import socket

    import torch
    import torch.distributed as dist

    from qualify.engines.base import Batch, EngineContext
    from qualify.engines.megatron import MegatronEngine
    from qualify.metrics import rel_l2
    from qualify.models.hf import load_model
    from qualify.models.hooks import activation_names, capture_layer_outputs
    from qualify.models.tiny import make_tiny_family
    from tests.integration._support import require_module

    require_module("megatron.core")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("nccl")
    try:
        model_dir = make_tiny_family(tiny_matrix.models.tiny, tmp_path / "models")["actor"]
        ids_BT = torch.randint(0, tiny_matrix.models.tiny.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
        engine = MegatronEngine()
        engine.setup(EngineContext(role="actor", precision="fp32", tp=1, rank=0, device="cuda:0", model_dir=model_dir,
                                   optimizer=tiny_matrix.optimizer, temperature=tiny_matrix.rollout.temperature,
                                   logprob_chunk_tokens=32, vocab_size=tiny_matrix.models.tiny.vocab_size,
                                   work_dir=tmp_path))
        got = engine.layer_outputs(Batch(input_ids_BT=ids_BT, response_mask_BT=torch.ones_like(ids_BT, dtype=torch.bool)))
        engine.close()
        want = capture_layer_outputs(load_model(model_dir, "actor").to("cuda:0"), ids_BT)
    finally:
        dist.destroy_process_group()
    assert list(got) == list(want) == activation_names(tiny_matrix.models.tiny.num_layers)
    errors = {name: rel_l2(got[name], want[name]) for name in want}
    print({k: f"{v:.2e}" for k, v in errors.items()})
    assert max(errors.values()) < 1e-5, errors
