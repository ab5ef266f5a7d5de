"""What recording a MoE rollout's routes costs, and how often vLLM's routes differ from the fp32 reference's own.

On the tiny MoE family of a matrix (default matrices/tiny-qwen3-moe.yaml), at each TP degree given, the same vLLM
request is captured twice side by side (qualify.rollout.capture.run_vllm, a fresh vLLM child each): without routes
(every prompt in one batched generate, as a dense rollout) and with routes (qualify.rollout.routes: the router
capture hook, one request at a time). Prints load and generate seconds, their ratio, whether the two captures sampled
the same tokens and logprobs, and per MoE layer how many fed tokens the fp32 HF actor routes to another expert set
than vLLM did (qualify.models.routing.agreement).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 TORCHDYNAMO_DISABLE=1 .venv/bin/python benchmarks/moe_capture_bench.py \
        [--matrix M] [--tp 1 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch

from qualify.matrix import load_matrix
from qualify.models.hf import load_model
from qualify.models.routing import agreement, own_routes_BTLK, routing
from qualify.models.tiny import make_tiny_family
from qualify.rollout.capture import capture_request, rollout_tensors, run_vllm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", default="matrices/tiny-qwen3-moe.yaml")
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    m = load_matrix(Path(args.matrix))
    models = make_tiny_family(m.models.tiny, Path(tempfile.mkdtemp(prefix="moe-bench-")))
    vocab = m.models.tiny.vocab_size
    eos = json.loads((models["actor"] / "config.json").read_text())["eos_token_id"]
    for tp in args.tp:
        for repeat in range(args.repeats):
            runs = {}
            for routes in (False, True):
                request = capture_request(m.capture, models["actor"], tp, vocab_size=vocab,
                                          eos_token_id=eos, routes=routes)
                runs[routes] = run_vllm(request)
            plain, routed = runs[False], runs[True]
            a, b = rollout_tensors(plain["results"]), rollout_tensors(routed["results"])
            same_tokens = torch.equal(a["input_ids_BT"], b["input_ids_BT"])
            same_logprobs = same_tokens and torch.equal(a["sampler_logprobs_BT"], b["sampler_logprobs_BT"])
            print(f"TP{tp} repeat {repeat}: load {plain['load_s']:.2f} s vs {routed['load_s']:.2f} s with routes; "
                  f"generate {plain['generate_s']:.2f} s batched vs {routed['generate_s']:.2f} s one request at a "
                  f"time with routes ({routed['generate_s'] / plain['generate_s']:.1f}x); same tokens {same_tokens}, "
                  f"same logprobs {same_logprobs}")
        ids = b["input_ids_BT"]
        own: list = []
        actor = load_model(models["actor"], "actor")
        with torch.no_grad(), routing(actor, None, own):
            actor(input_ids=ids, use_cache=False)
        theirs = own_routes_BTLK(own, *ids.shape)
        for a in agreement(b["routes_BTLK"], theirs):
            print(f"TP{tp} MoE layer {a['layer']}: the fp32 HF actor routes {a['tokens_differ']}/{a['tokens']} fed "
                  f"tokens to another expert set than vLLM ({a['pairs_differ']}/{a['pairs']} (token, slot) pairs)")


if __name__ == "__main__":
    main()
