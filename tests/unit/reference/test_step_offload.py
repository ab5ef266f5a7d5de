"""reference.offload: host keeps the FP32 master, its gradients and the AdamW state in host memory and runs forward
and backward in a compute copy; on one device it must give bitwise the plain path's evidence (every tensor of every
step, both roles, both precisions, K = 2 steps so that Adam's second step and the copy refresh are covered)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qualify.layout import RunLayout
from qualify.matrix import load_matrix
from qualify.models import hf
from qualify.models.tiny import build_tiny_model
from qualify.reference.context import ScoringContext
from qualify.reference.step import Control, reference_device, run_role


def _inputs(vocab: int, B: int = 4, T: int = 14) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab - 1, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 6:] = True
    mask[1, 11:] = False  # a padded row
    targets = {"old_logprobs_BT": -torch.rand(B, T, generator=g) * 5, "ref_logprobs_BT": -torch.rand(B, T, generator=g) * 5,
               "advantages_BT": torch.randn(B, T, generator=g), "returns_BT": torch.randn(B, T, generator=g),
               "old_values_BT": torch.randn(B, T, generator=g)}
    return {"input_ids_BT": ids, "response_mask_BT": mask}, targets


def _matrix(offload):
    m = load_matrix("matrices/tiny-qwen3.yaml")
    ref = dataclasses.replace(m.reference, device="cpu", offload=offload)
    return dataclasses.replace(m, reference=ref, ppo=dataclasses.replace(m.ppo, epochs=2, minibatches=1))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_offloaded_master_is_bitwise_the_plain_path(tmp_path, role, precision):
    spec = _matrix(None).models.tiny
    build_tiny_model(spec, role).save_pretrained(tmp_path)
    batch, targets = _inputs(spec.vocab_size)
    results = {}
    for offload in (None, "host"):
        matrix = _matrix(offload)
        master = hf.load_model(tmp_path, role)
        with torch.enable_grad():
            results[offload] = run_role(ScoringContext.of(matrix, RunLayout(tmp_path), "sha256:r", "sha256:t"), role, precision, Control(name="r0"), master, batch, targets,
                                        spec.vocab_size, tmp_path)
    plain, host = results[None], results["host"]
    assert len(plain["steps"]) == len(host["steps"]) == 2
    for k, (a, b) in enumerate(zip(plain["steps"], host["steps"])):
        for group in ("outputs", "grads", "updates", "moments"):
            assert a[group].keys() == b[group].keys()
            for name in a[group]:
                assert b[group][name].device.type == "cpu"
                assert torch.equal(a[group][name], b[group][name]), (k, group, name)
    assert plain["meta"] == host["meta"]


def test_offload_keeps_the_master_on_the_host_and_the_compute_copy_apart(tmp_path):
    spec = _matrix(None).models.tiny
    build_tiny_model(spec, "actor").save_pretrained(tmp_path)
    batch, targets = _inputs(spec.vocab_size)
    master = hf.load_model(tmp_path, "actor")
    before = {n: p.detach().clone() for n, p in master.named_parameters()}
    with torch.enable_grad():
        run_role(ScoringContext.of(_matrix("host"), RunLayout(tmp_path), "sha256:r", "sha256:t"), "actor", "fp32", Control(name="r0"), master, batch, targets, spec.vocab_size, tmp_path)
    # the master itself was stepped (not a copy of it), in place on the host
    assert all(p.device.type == "cpu" for p in master.parameters())
    assert any(not torch.equal(before[n], p) for n, p in master.named_parameters())


def test_reference_device_auto_follows_cuda_availability():
    m = load_matrix("matrices/tiny-qwen3.yaml")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert reference_device(dataclasses.replace(m.reference, device="auto")).type \
        == expected
    assert reference_device(dataclasses.replace(m.reference, device="cpu")).type == "cpu"


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_control_kept_on_its_device_is_bitwise_the_host_copy(tmp_path, device):
    """run_role(keep_on_device=True), used for a control measured where it ran and kept as a summary: the same
    tensors as the host copies, left on the run's device (outputs always on the host)."""
    spec = _matrix(None).models.tiny
    build_tiny_model(spec, "critic").save_pretrained(tmp_path)
    batch, targets = _inputs(spec.vocab_size)
    matrix = dataclasses.replace(_matrix(None), reference=dataclasses.replace(_matrix(None).reference, device=device))
    results = {}
    for keep in (False, True):
        master = hf.load_model(tmp_path, "critic")
        with torch.enable_grad():
            results[keep] = run_role(ScoringContext.of(matrix, RunLayout(tmp_path), "sha256:r", "sha256:t"), "critic",
                                     "bf16", Control(name="r1"), master, batch, targets, spec.vocab_size, tmp_path,
                                     keep_on_device=keep)
    for a, b in zip(results[False]["steps"], results[True]["steps"], strict=True):
        for group in ("outputs", "grads", "updates", "moments"):
            assert a[group].keys() == b[group].keys()
            for name in a[group]:
                assert a[group][name].device.type == "cpu"
                assert b[group][name].device.type == ("cpu" if group == "outputs" else device), (group, name)
                assert torch.equal(a[group][name], b[group][name].cpu()), (group, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the targets' forwards on the GPU")
def test_targets_made_on_the_gpu_agree_with_the_hosts(tmp_path):
    """compute_targets runs its forwards on the reference's device: on CUDA, host tensors within fp32 agreement of
    the same targets made on the CPU, and the same GAE of them."""
    from qualify.models.tiny import make_tiny_family
    from qualify.reference.targets import compute_targets

    matrix = _matrix(None)
    models = make_tiny_family(matrix.models.tiny, tmp_path / "models")
    batch, _ = _inputs(matrix.models.tiny.vocab_size)
    rollout = batch | {"sampler_logprobs_BT": -torch.rand(batch["input_ids_BT"].shape) * batch["response_mask_BT"]}
    made = {device: compute_targets(matrix.objective, dataclasses.replace(matrix.reference, device=device),
                                    matrix.rollout, models, rollout, matrix.models.tiny.vocab_size)
            for device in ("cpu", "cuda")}
    assert made["cpu"].keys() == made["cuda"].keys()
    for name, host in made["cpu"].items():
        gpu = made["cuda"][name]
        assert gpu.device.type == "cpu" and gpu.dtype == host.dtype, name
        if host.is_floating_point():
            assert torch.allclose(gpu, host, rtol=1e-4, atol=1e-4), (name, float((gpu - host).abs().max()))
        else:
            assert torch.equal(gpu, host), name
