"""A rollout's per-layer activations: every decoder layer's residual stream and the final norm, as vLLM's prefill of
each sampled sequence computed them (rollout.layer_outputs).

Where an engine claims the rollout's logprobs bit for bit (seed 002) and misses, these say in which layer its forward
first parts from vLLM's. vLLM's decoder layer does not return the residual stream: it returns (hidden_states, residual)
with the residual add fused into the next layer's input norm (vllm/model_executor/models/qwen3.py: the output is the
MLP's output and the residual before the MLP; vllm.ir.ops.fused_add_rms_norm adds them in fp32 and casts to the model's
dtype). The residual stream after layer i in Hugging Face's terms, 'model.layers.<i>' of qualify.models.hooks, is that
sum, computed here as the next norm computes it; 'model.norm' is the final norm's output. bind() sets a forward hook on
every decoder layer and the final norm, and a pre-hook on the decoder stack that keeps the token ids and positions each
forward is fed, in each worker (llm.apply_model); take() returns and clears what they kept. The pass is the prefill the
rollout engine's check against itself feeds (qualify.rollout.vllm_worker.prefill_logprobs: every sequence in one
batch), because vLLM's forward need not be batch-invariant: at Qwen3-0.6B widths on an H200, even in its
batch-invariant mode, vLLM's prefill of one sequence alone differs from its prefill of eight at once (benchmarks/LOG.md,
2026-12-04). split_forwards() gives each forward's rows back to their sequences by the ids and positions fed.

In the rollout directory, layers.safetensors holds one (B, T, H) float32 tensor per name (the values vLLM held, exact
in float32 for an fp32 or bf16 rollout), rows and positions as rollout.safetensors, 0 where no token was fed.
"""

from __future__ import annotations

from typing import Any

from qualify.errors import QualifyError

LAYERS_FILE = "layers.safetensors"
FINAL_NORM = "model.norm"
SOURCE = ("forward hooks on vLLM's decoder layers (hidden_states + residual, added in fp32 and cast to the model's "
          "dtype as the next norm adds them) and its final norm, bound in-process, during the batched prefill of the "
          "rollout engine's check against itself (every sampled sequence fed again as one prompt, all in one pass); "
          "each forward's rows given back to their sequences by the token ids and positions fed")
"""How the layers were recorded (rollout.json's layer_outputs.source)."""

_captured: dict[str, list[Any]] = {}
"""Per activation name, the (rows, H) tensors of each forward since the last take() (in a vLLM worker process)."""
_ids: list[Any] = []
"""The (rows,) token ids each forward embedded since the last take()."""
_positions: list[Any] = []
"""The (rows,) positions each forward's first decoder layer was given since the last take()."""


def layer_names(num_layers: int) -> list[str]:
    """The recorded names of a model with num_layers decoder layers, in forward order."""
    return [f"model.layers.{i}" for i in range(num_layers)] + [FINAL_NORM]


def bind(model: Any) -> int:
    """Hook every decoder layer and the final norm of a worker's model; the number of decoder layers (run by
    apply_model)."""
    base = model.model
    # the decoder stack's own __call__ is vLLM's compile wrapper (no module hooks): the ids from the embedding, the
    # positions from the first decoder layer, both called as modules
    base.embed_tokens.register_forward_pre_hook(_ids_hook, with_kwargs=True)
    base.layers[0].register_forward_pre_hook(_positions_hook, with_kwargs=True)
    for i, layer in enumerate(base.layers):
        layer.register_forward_hook(_residual_hook(f"model.layers.{i}"))
    base.norm.register_forward_hook(_norm_hook)
    _captured.clear()
    _ids.clear()
    _positions.clear()
    return len(base.layers)


def _ids_hook(module: Any, args: tuple, kwargs: dict) -> None:
    ids = kwargs["input_"] if "input_" in kwargs else args[0]
    if ids.is_floating_point():  # a tied head's module called on hidden states, not an embedding of ids
        return
    _ids.append(ids.detach().to("cpu").clone())


def _positions_hook(module: Any, args: tuple, kwargs: dict) -> None:
    positions = kwargs["positions"] if "positions" in kwargs else args[0]
    if positions.dim() > 1:  # M-RoPE's (3, rows): the text position is the first
        positions = positions[0]
    _positions.append(positions.detach().to("cpu").clone())


def _residual_hook(name: str):
    import torch

    def hook(module: Any, args: Any, output: Any) -> None:
        hidden, residual = output  # the next norm adds them in place: the sum is taken now, before it runs
        summed = (hidden.to(torch.float32) + residual.to(torch.float32)).to(hidden.dtype)
        _captured.setdefault(name, []).append(summed.to("cpu", torch.float32))
    return hook


def _norm_hook(module: Any, args: Any, output: Any) -> None:
    import torch

    normed = output[0] if isinstance(output, tuple) else output  # (normed, residual) when called with a residual
    _captured.setdefault(FINAL_NORM, []).append(normed.detach().to("cpu", torch.float32).clone())


def take(model: Any) -> dict[str, Any]:
    """What the hooks kept in this worker since the last take(): 'acts', per name the (rows, H) float32 tensor of
    each forward, and 'fed', each forward's (ids, positions); cleared."""
    if len(_ids) != len(_positions):
        raise QualifyError(f"rollout.layer_outputs: {len(_ids)} forwards embedded token ids, {len(_positions)} fed "
                           "positions to the first decoder layer (embeddings fed in place of ids?)")
    out = {"acts": {name: list(chunks) for name, chunks in _captured.items()}, "fed": list(zip(_ids, _positions))}
    _captured.clear()
    _ids.clear()
    _positions.clear()
    return out


def split_forwards(taken: dict[str, Any], names: list[str], sequences: dict[int, list[int]]) -> dict[int, dict]:
    """Each sequence's (len, H) activations per name from take()'s forwards (rank 0's: the capture runs at vLLM TP1).

    A forward's rows are runs of consecutive positions; a run belongs to the sequence whose tokens at those positions
    are the ids fed there and that has not had them yet, the longest such match first (sequences that share a prompt
    share those rows' values within one forward). Every sequence must get each of its positions exactly once: a cached
    prefix, a padded batch or a row the ids cannot place fails with the reason."""
    import torch

    acts, fed = taken["acts"], taken["fed"]
    if sorted(acts) != sorted(names):
        raise QualifyError(f"rollout.layer_outputs: vLLM's hooks captured {sorted(acts)}, expected {names}")
    if any(len(acts[name]) != len(fed) for name in names):
        raise QualifyError(f"rollout.layer_outputs: {len(fed)} forwards fed, but the hooks saw "
                           f"{ {name: len(acts[name]) for name in names} }")
    out = {b: {name: torch.zeros(len(seq), acts[name][0].shape[-1]) for name in names} for b, seq in sequences.items()}
    filled = {b: bytearray(len(seq)) for b, seq in sequences.items()}
    for f, (ids, positions) in enumerate(fed):
        ids, positions = ids.tolist(), positions.tolist()
        for name in names:
            if acts[name][f].shape[0] != len(ids):
                raise QualifyError(f"rollout.layer_outputs: forward {f} fed {len(ids)} tokens, {name} returned "
                                   f"{acts[name][f].shape[0]} rows (a padded batch?)")
        i = 0
        while i < len(ids):
            b, n = _longest_run(ids, positions, i, sequences, filled)
            if not n:
                raise QualifyError(f"rollout.layer_outputs: forward {f} row {i} (token {ids[i]} at position "
                                   f"{positions[i]}) belongs to no sequence of the pass that still lacks it (the "
                                   "trailing rows of a padded batch, or a token the pass did not feed)")
            p = positions[i]
            for name in names:
                out[b][name][p:p + n] = acts[name][f][i:i + n]
            filled[b][p:p + n] = b"\x01" * n
            i += n
    missing = {b: m.count(0) for b, m in filled.items() if 0 in m}
    if missing:
        raise QualifyError(f"rollout.layer_outputs: positions no forward computed, per row {missing} (a cached prefix "
                           "leaves them out)")
    return out


def _longest_run(ids: list[int], positions: list[int], i: int, sequences: dict[int, list[int]],
                 filled: dict[int, bytearray]) -> tuple[int, int]:
    """(sequence, rows) of the longest match of the run starting at row i: consecutive positions, the sequence's
    tokens there, none of them filled yet; (-1, 0) when none matches."""
    best, length, p = -1, 0, positions[i]
    for b, seq in sequences.items():
        if p >= len(seq) or seq[p] != ids[i] or filled[b][p]:
            continue
        n = 0
        while (i + n < len(ids) and p + n < len(seq) and positions[i + n] == p + n and seq[p + n] == ids[i + n]
               and not filled[b][p + n]):
            n += 1
        if n > length:
            best, length = b, n
    return best, length


def layers_tensors(per_row: dict[int, dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    """(B, T, H) float32 per name of right-padded rows (T the longest row), 0 where no sequence was fed; per_row
    maps a row index to its sequence's (rows, H) activations."""
    import torch

    first = next(iter(per_row.values()))
    B, T = len(lengths), max(lengths)
    out = {name: torch.zeros(B, T, t.shape[-1], dtype=torch.float32) for name, t in first.items()}
    for b, acts in per_row.items():
        for name, t in acts.items():
            out[name][b, :t.shape[0]] = t
    return out
