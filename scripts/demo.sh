#!/usr/bin/env bash
# The main job on a matrix: whatever stages exist, in order, then a summary.
set -euo pipefail
matrix=${1:-matrices/tiny-qwen3.yaml}
run=${2:-runs/tiny-qwen3}
q=.venv/bin/qualify
start=$(date +%s)
$q matrices validate "$matrix"
echo "demo finished in $(( $(date +%s) - start )) s"
