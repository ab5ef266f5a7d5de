"""Make the tiny Qwen3 family locally from a seed: actor, reference policy, critic, reward.

Actor and reference are Qwen3ForCausalLM; critic and reward are Qwen3ForTokenClassification with
one label (a Qwen3 backbone plus a scalar head). Everything is saved as safetensors with its
config, nothing is downloaded. The reference policy is drawn from a different seed than the actor
so that KL terms are not trivially zero.
"""

from __future__ import annotations

from pathlib import Path

from qualify.matrix import TinyModel
from qualify.schema import to_dict
from qualify.stages import complete_stage, fingerprint, prepare_stage, reuse_complete

SEED_OFFSETS = {"actor": 0, "reference": 1, "critic": 2, "reward": 3}


def is_moe_role(spec: TinyModel, role: str) -> bool:
    """Whether the role is a Qwen3-MoE model: the policies (actor and reference) of a family with a moe section."""
    return spec.moe is not None and role in ("actor", "reference")


def tiny_config(spec: TinyModel, role: str):
    """transformers Qwen3Config (Qwen3MoeConfig for a MoE family's policies) for one role of the tiny family."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    extra = {"num_labels": 1, "classifier_dropout": 0.0} if role in ("critic", "reward") else {}
    cls = Qwen3Config
    if is_moe_role(spec, role):
        cls = Qwen3MoeConfig
        # every layer sparse (decoder_sparse_step 1, no mlp_only_layers); no router auxiliary loss in the outputs
        extra = {"num_experts": spec.moe.num_experts, "num_experts_per_tok": spec.moe.top_k,
                 "moe_intermediate_size": spec.moe.moe_intermediate_size, "norm_topk_prob": spec.moe.norm_topk_prob,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False}
    return cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=bool(spec.tie_word_embeddings) and role in ("actor", "reference"),
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=spec.vocab_size - 1,
        pad_token_id=0,
        torch_dtype="float32",
        **extra,
    )


def build_tiny_model(spec: TinyModel, role: str):
    """The role's model with weights drawn from spec.seed + the role's offset (fp32)."""
    import torch

    from qualify.models.checkpoint import quiet_transformers
    from qualify.models.hf import hf_class

    quiet_transformers()
    config = tiny_config(spec, role)
    cls = hf_class(role, config.model_type)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed + SEED_OFFSETS[role])
        model = cls(config).to(torch.float32)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Norm weights of 1 would hide a norm applied to the wrong shard: draw them around 1.
                torch.nn.init.normal_(param, mean=1.0, std=spec.initializer_range)
            if name.endswith("mlp.gate.weight"):
                # A MoE router starts at zero (every expert equally likely, ties broken by index): draw it.
                torch.nn.init.normal_(param, std=spec.initializer_range)
        if role in ("critic", "reward"):
            # The default init leaves a zero-ish scalar head; draw it like every other weight.
            torch.nn.init.normal_(model.score.weight, std=spec.initializer_range)
            torch.nn.init.normal_(model.score.bias, std=spec.initializer_range)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()


PARALLEL_PARAMETERS = 50_000_000
"""From this many parameters a model, the family's roles are made in parallel processes: making a role at Qwen3-0.6B
is mostly the serial draws of its weights on one core, so four roles made together take about one role's time
(benchmarks/LOG.md)."""


def make_tiny_family(spec: TinyModel, models_dir: Path) -> dict[str, Path]:
    """Write every role's checkpoint under models_dir/<role>; complete ones are kept as they are. Each role is drawn
    from its own seed in its own process where the models are large (the same bits: a process's draws depend on its
    seed alone). A family too large for this machine's memory is refused before a weight is drawn."""
    from qualify.errors import MatrixError
    from qualify.memory import host_memory_bytes, tiny_family_problem

    too_large = tiny_family_problem(spec, host_memory_bytes())
    if too_large:
        raise MatrixError(too_large)
    paths, todo = {}, []
    for role in SEED_OFFSETS:
        out = Path(models_dir) / role
        paths[role] = out
        settings = fingerprint({"tiny": to_dict(spec), "role": role})
        if not reuse_complete(out, settings, f"tiny {role} model"):
            todo.append((spec, role, out, settings))
    workers = family_workers(spec, len(todo))
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_make_role, *zip(*todo)))
    else:
        for args in todo:
            _make_role(*args)
    return paths


def family_workers(spec: TinyModel, roles: int) -> int:
    """How many roles to make at once: one below PARALLEL_PARAMETERS; else as many as the CPUs and the memory hold
    (a role's process holds its fp32 model and the bytes save_pretrained writes, about 2.5 times the model)."""
    import os

    params = policy_parameters(spec)
    if roles < 2 or params < PARALLEL_PARAMETERS:
        return 1
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 1
    return max(1, min(roles, os.cpu_count() or 1, available // int(2.5 * 4 * params)))


def policy_parameters(spec: TinyModel) -> int:
    """The policy's weight matrices' parameters (embedding, head unless tied, attention and MLP; norms left out)."""
    return spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2) + spec.num_layers * (
        spec.hidden_size * spec.head_dim * (2 * spec.num_heads + 2 * spec.num_kv_heads)
        + 3 * spec.hidden_size * spec.intermediate_size)


def _make_role(spec: TinyModel, role: str, out: Path, settings: str) -> None:
    prepare_stage(out)
    model = build_tiny_model(spec, role)
    model.save_pretrained(out, safe_serialization=True)
    follow_umask(out)
    complete_stage(out, {"role": role, "seed": spec.seed + SEED_OFFSETS[role], "settings": settings})


def follow_umask(directory: Path) -> None:
    """Give every file in directory the mode the process's umask gives a new file (save_pretrained writes its
    weights 0600 whatever the umask: another user of a shared run directory could not read them)."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    for path in Path(directory).rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~mask)

