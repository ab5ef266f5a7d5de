"""torch-tp on a model whose LM head is its input embedding (tie_word_embeddings, as Qwen3-0.6B): the head stays tied
at TP1 and TP2 over real gloo ranks, so the engine's parameters are the model's own (no 'lm_head.weight' beside the
embedding) and the embedding's gradient holds both its parts, as Hugging Face's own backward gives it.

The negative control is the plan before the fix (the head sharded like an untied one): parallelize_module swaps in a
DTensor head, which unties it; the engine then reports an extra 'lm_head.weight' and an embedding gradient without the
head's part (the 0.6B chain on one H200 measured its rel_l2 at 0.46 off the reference's)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from qualify.matrix import Optimizer, TinyModel

SPEC = TinyModel(seed=5, vocab_size=96, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32, max_position_embeddings=64, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tied_actor(tmp_path_factory) -> Path:
    from qualify.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("tied") / "actor"
    model = build_tiny_model(SPEC, "actor")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(out, safe_serialization=True)
    return out


def ids() -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (3, 10), generator=torch.Generator().manual_seed(1))


def hf_grads(model_dir: Path) -> dict[str, torch.Tensor]:
    """The model's own backward of the summed full-formula logprobs (fp32, one process)."""
    from qualify.models.hf import load_model, scores_from_outputs

    model = load_model(model_dir, "actor", "sdpa")
    x = ids()
    scores_from_outputs("actor", model(input_ids=x, use_cache=False).logits, x, 1.0, 1024, SPEC.vocab_size).sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, tp: int, port: int, model_dir: str, untie: bool, queue) -> None:
    import torch.distributed as dist

    from qualify.case.context import Batch, EngineContext
    from qualify.engines import torch_tp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    try:
        if untie:  # the plan before the fix: the head sharded as if it were untied
            plan = torch_tp.tp_plan
            torch_tp.tp_plan = lambda role, vocab_parallel=False, moe=False, tied=False: plan(role, vocab_parallel, moe)
        engine = torch_tp.TorchTPEngine()
        engine.setup(EngineContext(role="actor", precision="fp32", tp=tp, rank=rank, device="cpu",
                                   model_dir=Path(model_dir), optimizer=Optimizer(), temperature=1.0,
                                   logprob_chunk_tokens=1024, vocab_size=SPEC.vocab_size, work_dir=Path(model_dir)))
        x = ids()
        engine.backward(engine.score(Batch(input_ids_BT=x, response_mask_BT=torch.ones_like(x, dtype=torch.bool))).sum())
        grads = engine.grads()
        if rank == 0:  # as numpy arrays: pickled whole, not shared through a file descriptor the exit closes
            queue.put({n: g.numpy() for n, g in grads.items()})
    finally:
        dist.destroy_process_group()


def engine_grads(model_dir: Path, tp: int, untie: bool = False) -> dict[str, torch.Tensor]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, tp, port, str(model_dir), untie, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    grads = {n: torch.from_numpy(a) for n, a in queue.get(timeout=300).items()}
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    return grads


@pytest.mark.parametrize("tp", [1, 2])
def test_a_tied_head_stays_tied_and_its_embedding_gradient_is_whole(tied_actor, tp):
    expected, got = hf_grads(tied_actor), engine_grads(tied_actor, tp)
    assert sorted(got) == sorted(expected) and "lm_head.weight" not in got
    for name, g in expected.items():  # TP2 adds its partial sums in another order: fp32 rounding, no more
        assert rel_l2(got[name], g) < 1e-5, name


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_the_head_sharded_as_if_untied_unties_it(tied_actor):
    expected, got = hf_grads(tied_actor), engine_grads(tied_actor, 1, untie=True)
    assert "lm_head.weight" in got and "lm_head.weight" not in expected  # an extra parameter, trained apart
    embed = "model.embed_tokens.weight"
    assert rel_l2(got[embed], expected[embed]) > 0.1  # the embedding's gradient lacks the head's part
