"""qualify.tensor_codec decodes on a GPU to the bits the CPU decodes: every operation of its predictions is correctly
rounded on both (CUDA's square root, products, sums and quotients against numpy's and the CPU's), and a coded case
read on the GPU is the case read on the CPU, tensor for tensor. Needs CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qualify.errors import EvidenceError
from qualify.store import TensorFile
from qualify.tensor_codec import decoding
from tests.unit.tensor_codec.test_decode import adamw_steps, write_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="decoding on a GPU needs CUDA")


def test_cuda_square_root_is_numpys_for_every_positive_fp32_value():
    """All 2^31 non-negative fp32 bit patterns (normals, subnormals, infinity, NaNs): CUDA's sqrt gives numpy's
    bits (the CPU's correctly rounded instruction) in every one that is not a NaN, and a NaN where numpy's is."""
    chunk = 1 << 27
    for start in range(0, 1 << 31, chunk):
        b = torch.arange(start, start + chunk, dtype=torch.int64).to(torch.int32)
        x = b.view(torch.float32)
        ours = torch.sqrt(x.cuda()).cpu().numpy()
        theirs = np.sqrt(x.numpy())
        nan = np.isnan(theirs)
        assert np.array_equal(np.isnan(ours), nan)
        differ = np.flatnonzero(ours.view(np.int32)[~nan] != theirs.view(np.int32)[~nan])
        assert not differ.size, f"{differ.size} roots differ from 0x{start:08x}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_products_sums_and_quotients_are_the_cpus(dtype):
    """2^24 random pairs over 40 binades (and their signs): product, sum, difference and quotient on the GPU are the
    CPU's bits (each correctly rounded on both)."""
    gen = torch.Generator().manual_seed(29)
    n = 1 << 24

    def draw():
        mant = torch.rand(n, generator=gen, dtype=torch.float64) + 1.0
        exp = torch.randint(-20, 20, (n,), generator=gen).to(torch.float64)
        sign = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
        return (sign * mant * torch.exp2(exp)).to(dtype)

    a, b = draw(), draw()
    ga, gb = a.cuda(), b.cuda()
    for op in (torch.mul, torch.add, torch.sub, torch.div):
        cpu, gpu = op(a, b), op(ga, gb).cpu()
        assert torch.equal(cpu, gpu), f"{op.__name__} in {dtype}: {int((cpu != gpu).sum())} of {n} differ"


@pytest.mark.parametrize("bf16_grads", [False, True])
def test_a_case_decoded_on_the_gpu_is_the_case_decoded_on_the_cpu(tmp_path, bf16_grads):
    model, records, starts, final = adamw_steps(tmp_path, steps=3, bf16_grads=bf16_grads)
    case = tmp_path / "case"
    write_case(case, model, records, starts, final)
    checked = 0
    for k in range(3):
        for group in ("grads", "updates", "moments"):
            f = TensorFile(case / f"step{k}" / f"{group}.safetensors")
            for name in f:
                with decoding():  # nothing decoded before: each tensor's whole chain decoded on the GPU
                    on_gpu = f.tensor(name, "cuda")
                assert on_gpu.is_cuda
                assert torch.equal(on_gpu.cpu().view(torch.int32), f[name].view(torch.int32)), (k, group, name)
                checked += 1
    assert checked == 3 * (4 + 4 + 8)


def test_a_changed_start_fails_the_gpu_decode_by_name(tmp_path):
    """The negative control: the start of a first step's coded update changed after the case was written; decoded
    on the GPU it is refused by its check, as on the CPU, never read as another number."""
    from safetensors.torch import load_file, save_file

    model, records, starts, final = adamw_steps(tmp_path, steps=1)
    case = tmp_path / "case"
    write_case(case, model, records, starts, final)
    weights = load_file(str(model / "model.safetensors"))
    weights["layer.weight"] = weights["layer.weight"] + 1e-3
    save_file(weights, str(model / "model.safetensors"))
    with pytest.raises(EvidenceError, match="layer.weight does not decode"):
        TensorFile(case / "step0" / "updates.safetensors").tensor("layer.weight", "cuda")


def test_no_tensor_fell_back_to_the_cpu(tmp_path):
    """After a case decoded on the GPU, no tensor was made again on the CPU (the DecodeCache's fell_back): the
    GPU's predictions are the written ones, not rescued by the fallback."""
    model, records, starts, final = adamw_steps(tmp_path, steps=2, bf16_grads=True)
    write_case(tmp_path / "case", model, records, starts, final)
    with decoding() as cache:
        for k in range(2):
            for group in ("updates", "moments"):
                f = TensorFile(tmp_path / "case" / f"step{k}" / f"{group}.safetensors")
                for name in f:
                    f.tensor(name, "cuda")
        assert cache.held("cuda") > 0  # decoded there, and kept
    assert cache.fell_back == []


def test_a_gpu_tensors_crc_is_zlibs_crc_of_its_bytes(monkeypatch):
    """A GPU tensor's CRC32 is summed in pieces, each copied to a pinned host buffer by its thread: zlib's CRC of
    the whole tensor's bytes."""
    import zlib

    from qualify.tensor_codec import checksum

    t = torch.randn(3_000_001, generator=torch.Generator().manual_seed(5))
    whole = zlib.crc32(t.numpy().view(np.uint8).data)
    for chunk in (1 << 16, 1 << 20, 1 << 26):
        monkeypatch.setattr(checksum, "CRC_CHUNK", chunk)
        assert checksum.crc(t.cuda()) == whole


@pytest.mark.parametrize("bf16_grads", [False, True])
def test_a_case_coded_on_the_gpu_is_the_case_coded_on_the_cpu_byte_for_byte(tmp_path, bf16_grads):
    """The case worker codes on its GPU (StepCoding.device): every file is byte for byte the one the CPU writes,
    so any machine reads it; its tensors on the GPU, as a GPU engine's are."""
    import hashlib

    from qualify.compare import write_step
    from qualify.store import write_json
    from qualify.tensor_codec import Adam, StepCoding
    from tests.unit.tensor_codec.test_decode import OPT

    model, records, starts, final = adamw_steps(tmp_path, steps=3, bf16_grads=bf16_grads)
    digests = {}
    for where in ("cpu", "cuda"):
        case, startable = tmp_path / where, None
        for k, step in enumerate(records):
            new = starts[k + 1] if k + 1 < len(starts) else final
            on = {g: {n: t.to(where) for n, t in group.items()} for g, group in step.items()}
            coding = StepCoding(Adam.of(OPT), k, records[k - 1]["moments"] if k else None, starts[k], new, model,
                                startable, device=None if where == "cpu" else "cuda")
            startable = write_step(case / f"step{k}", on, coding=coding)
        write_json(case / "meta.json", {"num_steps": len(records)})
        digests[where] = {f.relative_to(case).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
                          for f in sorted(case.rglob("*.safetensors"))}
    assert digests["cuda"] == digests["cpu"] and len(digests["cpu"]) == 3 * 4


def test_a_files_gpu_view_reads_each_tensor_there(tmp_path):
    """TensorFile.on('cuda') (qualify.resident.on_demand, for runs that do not fit the GPU whole): every tensor,
    coded or plain, comes back on the GPU with the CPU's bits."""
    model, records, starts, final = adamw_steps(tmp_path, steps=2, bf16_grads=True)
    write_case(tmp_path / "case", model, records, starts, final)
    for k in range(2):
        for group in ("grads", "updates", "moments"):
            f = TensorFile(tmp_path / "case" / f"step{k}" / f"{group}.safetensors")
            view = f.on("cuda")
            for name in f:
                t = view[name]
                assert t.is_cuda and torch.equal(t.cpu().view(torch.int32), f[name].view(torch.int32))
