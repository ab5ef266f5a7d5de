"""qualify.tensor_codec: a case's gradients, moments and updates kept in fewer bytes and read back bit for bit.

The steps are real: torch's AdamW (the for-loop form) with torch's clip_grad_norm_ on a small model, the case worker's
arithmetic (updates = new - start, fp32). Every read is compared bit for bit with what was written; the sizes with a
plain file's; a changed start or a tampered residual is an error, never a different number.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qualify.compare import GROUPS, load_run, write_step
from qualify.errors import EvidenceError
from qualify.store import TensorFile, read_tensors, write_json, write_tensors
from qualify.tensor_codec import CODEC_KEY, Adam, StepCoding

OPT = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "max_grad_norm": 0.5}
SHAPES = {"embed.weight": (64, 16), "layer.weight": (16, 16), "norm.weight": (16,), "head.bias": (3,)}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and a.shape == b.shape and torch.equal(a.view(torch.int32),
                                                                                       b.view(torch.int32))


def adamw_steps(tmp_path, steps: int = 3, bf16_grads: bool = False, optimizer=None):
    """A model directory and `steps` real AdamW steps taken from it, as the case worker records them: (model_dir,
    [step dicts], [starts], final params)."""
    gen = torch.Generator().manual_seed(7)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02 + (1.0 if n == "norm.weight" else 0.0))
              for n, s in SHAPES.items()}
    model = tmp_path / "models" / "actor"
    model.mkdir(parents=True)
    save_file({n: p.detach().clone() for n, p in params.items()}, str(model / "model.safetensors"))
    opt = (optimizer or torch.optim.AdamW)(params.values(), lr=OPT["lr"], betas=OPT["betas"], eps=OPT["eps"],
                                           weight_decay=OPT["weight_decay"], foreach=False)
    records, starts = [], []
    start = {n: p.detach().clone() for n, p in params.items()}
    for k in range(steps):
        for p in params.values():
            g = torch.randn(p.shape, generator=gen) * (0.5 + k)
            p.grad = g.bfloat16().float() if bf16_grads else g
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        norm = torch.nn.utils.clip_grad_norm_(params.values(), OPT["max_grad_norm"])
        opt.step()
        new = {n: p.detach().clone() for n, p in params.items()}
        state = opt.state
        records.append({"outputs": {"grad_norm": norm.detach().float().reshape(())},
                        "grads": grads,
                        "updates": {n: new[n] - start[n] for n in params},
                        "moments": {f"{key}/{n}": state[p][key].detach().clone() for key in ("exp_avg", "exp_avg_sq")
                                    for n, p in params.items() if key in state[p]}})
        starts.append(start)
        start = new
    return model, records, starts, start


def write_case(directory, model, records, starts, final, coded: bool = True):
    startable = None
    for k, step in enumerate(records):
        new = starts[k + 1] if k + 1 < len(starts) else final
        coding = StepCoding(Adam.of(OPT), k, records[k - 1]["moments"] if k else None, starts[k], new, model,
                            startable) if coded else None
        startable = write_step(directory / f"step{k}", step, coding=coding)
    write_json(directory / "meta.json", {"num_steps": len(records)})


def codec_doc(path):
    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {})[CODEC_KEY])


@pytest.mark.parametrize("bf16_grads", [False, True])
def test_real_adamw_steps_read_back_bit_for_bit_in_fewer_bytes(tmp_path, bf16_grads):
    model, records, starts, final = adamw_steps(tmp_path, bf16_grads=bf16_grads)
    case, plain = tmp_path / "candidates" / "case", tmp_path / "plain"
    write_case(case, model, records, starts, final)
    write_case(plain, model, records, starts, final, coded=False)
    for k, step in enumerate(records):
        run = load_run(case, k)
        for group in GROUPS[1:]:
            got = getattr(run, group)
            assert list(got) == sorted(step[group]), group  # a plain file's order (safetensors sorts by name)
            for name, want in step[group].items():
                assert same_bits(got[name], want), (k, group, name)
                assert TensorFile(case / f"step{k}" / f"{group}.safetensors").spec(name) == (tuple(want.shape),
                                                                                            torch.float32)
        # the whole-file reader gives the same logical tensors
        assert all(same_bits(read_tensors(case / f"step{k}" / "moments.safetensors")[n], t)
                   for n, t in step["moments"].items())
        # the moments are torch's AdamW of the clipped gradients: predicted exactly (nothing kept but the header)
        doc = codec_doc(case / f"step{k}" / "moments.safetensors")
        assert {e["residual"] for e in doc["coded"].values()} == {"zero"}, doc
        # every update is kept as its new parameter's difference from AdamW's step, which torch's is in all but a few
        # elements (a sparse list, or nothing)
        updates = codec_doc(case / f"step{k}" / "updates.safetensors")["coded"]
        assert set(updates) == set(SHAPES) and {e["residual"] for e in updates.values()} <= {"zero", "sparse"}, updates
    size = {d: sum(f.stat().st_size for f in d.rglob("*.safetensors")) for d in (case, plain)}
    assert size[case] < 0.5 * size[plain], size
    grads_form = codec_doc(case / "step0" / "grads.safetensors")["coded"] if bf16_grads else {}
    assert set(grads_form) == (set(SHAPES) if bf16_grads else set())


def test_a_reader_counts_its_decodes_crc_on_its_own_meter(tmp_path):
    """What a coded case's decode summed in CRC32 is counted by the meter its reader opened (as the candidate stage's
    judge does): every decoded moment's and new parameter's bytes, and nothing outside the block."""
    from qualify.tensor_codec import metering

    model, records, starts, final = adamw_steps(tmp_path, steps=1)
    case = tmp_path / "case"
    write_case(case, model, records, starts, final)
    with metering() as meter:
        moments = TensorFile(case / "step0" / "moments.safetensors")
        decoded = {n: moments[n] for n in moments}
    assert decoded and meter.seconds >= 0.0
    assert meter.bytes == sum(t.numel() * 4 for t in records[0]["moments"].values())
    with metering() as later:
        pass
    assert later.bytes == 0


def test_a_plain_file_is_written_as_before_when_nothing_is_coded(tmp_path):
    """fp32 gradients that are not bf16 values, and no coding: byte-identical to write_tensors' file."""
    _, records, _, _ = adamw_steps(tmp_path, steps=1)
    write_step(tmp_path / "a", records[0])
    for group in GROUPS:
        write_tensors(tmp_path / "b" / f"{group}.safetensors", records[0][group])
        assert (tmp_path / "a" / f"{group}.safetensors").read_bytes() == \
            (tmp_path / "b" / f"{group}.safetensors").read_bytes()


def test_a_changed_start_is_an_error_not_another_number(tmp_path):
    model, records, starts, final = adamw_steps(tmp_path, steps=2)
    case = tmp_path / "candidates" / "case"
    write_case(case, model, records, starts, final)
    tensors = read_tensors(model / "model.safetensors")
    tensors["layer.weight"] = tensors["layer.weight"] + 1e-3
    save_file(tensors, str(model / "model.safetensors"))
    run = load_run(case, 1)  # step 1 starts from step 0's new parameters, themselves decoded from the model
    with pytest.raises(EvidenceError, match=r"layer\.weight does not decode to what was written .*start"):
        run.updates["layer.weight"]
    assert same_bits(load_run(case, 0).updates["embed.weight"], records[0]["updates"]["embed.weight"])


def test_a_tampered_residual_is_an_error(tmp_path):
    model, records, starts, final = adamw_steps(tmp_path, steps=2)
    case = tmp_path / "case"
    write_case(case, model, records, starts, final)
    path = case / "step1" / "moments.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata, stored = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    doc = json.loads(metadata[CODEC_KEY])
    key = "exp_avg/layer.weight"
    doc["coded"][key]["residual"] = "sparse"
    stored[f"{key}#i"], stored[f"{key}#v"] = torch.tensor([3], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    save_file(stored, str(path), metadata={CODEC_KEY: json.dumps(doc)})
    with pytest.raises(EvidenceError, match="exp_avg/layer.weight does not decode"):
        load_run(case, 1).moments[key]


def test_an_optimizer_that_is_not_adamw_loses_nothing(tmp_path):
    """SGD with momentum keeps no Adam moments; Adamax's exp_inf is not exp_avg_sq: the predictions are wrong and the
    differences are kept whole."""
    def adamax(params, lr, betas, eps, weight_decay, foreach):
        return torch.optim.Adamax(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach)

    model, records, starts, final = adamw_steps(tmp_path, optimizer=adamax)
    for step in records:  # Adamax's infinity norm under the name AdamW's second moment has
        step["moments"] = {k.replace("exp_inf", "exp_avg_sq"): v for k, v in step["moments"].items()}
    case = tmp_path / "case"
    write_case(case, model, records, starts, final)
    for k, step in enumerate(records):
        run = load_run(case, k)
        for group in ("updates", "moments"):
            assert all(same_bits(getattr(run, group)[n], t) for n, t in step[group].items())


def test_nan_inf_and_negative_zero_read_back(tmp_path):
    model, records, starts, final = adamw_steps(tmp_path, steps=1)
    step = records[0]
    m = step["moments"]["exp_avg/layer.weight"]
    m.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45])
    case = tmp_path / "case"
    write_case(case, model, records, starts, final)
    assert same_bits(load_run(case, 0).moments["exp_avg/layer.weight"], m)
