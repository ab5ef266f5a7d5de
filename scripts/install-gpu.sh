#!/usr/bin/env bash
# Install qualify's GPU stack into a CUDA host's Python (the one whose torch is a CUDA build), from
# requirements/gpu.lock: vLLM 0.26.0 (which pins torch 2.11.0, CUDA 13), megatron-core, DeepSpeed and what they need
# that such a host does not already have. Nothing is installed when every pin is already there.
# Usage: scripts/install-gpu.sh [--wheelhouse DIR]   (PYTHON: the interpreter, default python3)
#   --wheelhouse DIR  install offline from wheels laid out beforehand (a host with no registry access; fill DIR on a
#                     machine that has one with `pip download --no-deps -r requirements/gpu.lock -d DIR` for the
#                     host's Python and platform: see benchmarks/gpu_vllm_wheels.sh for the flags)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
source=()
while [ $# -gt 0 ]; do
  case $1 in
    --wheelhouse) [ -d "${2:-}" ] || { echo "install-gpu.sh: --wheelhouse needs a directory, got '${2:-}'" >&2; exit 2; }
                  source=(--no-index --find-links "$2"); shift 2 ;;
    *) echo "install-gpu.sh: unknown argument '$1' (usage: install-gpu.sh [--wheelhouse DIR])" >&2; exit 2 ;;
  esac
done
"$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "install-gpu.sh: this Python'"'"'s torch sees no CUDA GPU")'
if "$python" scripts/check_gpu_env.py --quiet; then
  exit 0
fi
# --no-deps: the lock names every package; pip must not replace the host's CUDA torch with another build
"$python" -m pip install -q --no-deps "${source[@]}" -r requirements/gpu.lock
PYTHONWARNINGS=ignore "$python" -m pip install -q --no-deps --no-build-isolation -e .
"$python" scripts/check_gpu_env.py
