#!/usr/bin/env bash
# qualify's product path on a CUDA host with GPU vLLM installed offline (two GPUs for the TP2 matrices): vLLM 0.26.0
# capture through `qualify reference` at TP1 and TP2, freeze, every built-in engine at TP1 and TP2, verify, the
# vLLM-vs-HF fp32 probe, `qualify rounds`; and the same chain through a real Slurm.
# The offline bundle comes from benchmarks/gpu_vllm_wheels.sh (run where pip reaches a registry), copied to this host:
#   part DIR              copy one part of the bundle (a .gpu/xz/pNN folder; for slurm also .gpu/slurm-debs) into
#                         /tmp/gpu-parts (a bundle sent in several parts: once per part)
#   install               join the parts in /tmp/gpu-parts, check them against SHA256SUMS, unpack the site to /tmp/site
#   run OUT [MATRIX] [RUN]  install, then the chain, probe and rounds
#   exact OUT: seed 002's counts (benchmarks/gpu-tiny-exact.yaml and its -off twin: rollout, layout and rounds rows)
#   chain OUT [MATRIX] [RUN]: as run, without the probe and rounds (reference with its capture, freeze, every case,
#                         verify, report; REPORT_JSON=1 also writes OUT/report.json, judging every case once more)
#   slurm OUT [MATRIX] [RUN] [CASES]: scripts/slurm-gpu.sh, then `qualify sbatch --submit --wait` with one
#                         candidate task requeued while it runs
# Run it from a clean copy of a commit (git archive HEAD | tar -x -C DIR) so the figures belong to that commit, not
# to a working tree in flux.
# Usage: bash benchmarks/gpu_vllm_chain.sh part DIR | install | run OUT [MATRIX] [RUN] | chain OUT [MATRIX] [RUN]
#        | exact OUT | slurm OUT [MATRIX] [RUN] [CASES]
set -euo pipefail
here=$PWD  # where the parts given to `part` are
parts=/tmp/gpu-parts
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # keep: multicast stays off
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore VLLM_USE_FLASHINFER_SAMPLER=0
qualify() { python3 -c 'import sys; from qualify.cli.app import main; sys.argv[0] = "qualify"; main()' "$@"; }
timed() {  # timed LABEL COMMAND...: run, print its wall time and exit code
  local label=$1 start=$EPOCHREALTIME rc=0; shift
  "$@" || rc=$?
  awk -v s="$start" -v e="$EPOCHREALTIME" -v n="$label" -v rc=$rc 'BEGIN{printf "== %s: exit %s in %.1f s\n", n, rc, e - s > "/dev/stderr"}'
  return $rc
}

install() {
  [ -f /tmp/site/.installed ] && return
  if grep -q site.tar.xz $parts/SHA256SUMS; then  # the unpacked site, xz-compressed (gpu_vllm_wheels.sh)
    (cd $parts && cat part-* > /tmp/site.tar.xz && cd /tmp && sha256sum -c $parts/SHA256SUMS)
    mkdir -p /tmp/site && xz -dc -T0 /tmp/site.tar.xz | tar -x -C /tmp/site && rm /tmp/site.tar.xz
  else  # the wheels, tarred
    (cd $parts && cat part-* > /tmp/bundle.tar && cd /tmp && sha256sum -c $parts/SHA256SUMS)
    mkdir -p /tmp/bundle && tar -xf /tmp/bundle.tar -C /tmp/bundle && rm /tmp/bundle.tar
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      /tmp/bundle/dl/vllm-*.whl /tmp/bundle/deps/*.whl /tmp/bundle/.whl/*.whl
  fi
  touch /tmp/site/.installed
}

versions() {
  python3 - <<'PY'
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "vllm", md.version("vllm"), "transformers",
      md.version("transformers"), "deepspeed", md.version("deepspeed"), "megatron-core", md.version("megatron-core"),
      "triton", md.version("triton"), "|", torch.cuda.device_count(), "x", torch.cuda.get_device_name(0))
PY
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
}

run() {
  local out=${1:?} matrix=${2:-benchmarks/gpu-tiny-tp2.yaml} run=${3:-runs/gpu-tiny-tp2}
  install
  [ -e .whl ] || [ ! -d /tmp/bundle/.whl ] || ln -s /tmp/bundle/.whl .whl  # gpu_chain.sh installs .whl/*.whl again (a no-op upgrade)
  versions
  mkdir -p "$out"
  timed "qualify reference --stage capture (vLLM TP1 and TP2)" qualify reference "$matrix" --run "$run" --stage capture
  local rc=0
  bash benchmarks/gpu_chain.sh "$out" "$matrix" "$run" || rc=$?
  timed "qualify verify" qualify verify "$run/acceptance/acceptance.json" || true
  python3 - "$run" <<'PY' || true
import json, sys
from safetensors.torch import load_file
run = sys.argv[1]
doc = json.load(open(f"{run}/reference/reference.json"))
print("reference.json:", json.dumps({k: doc[k] for k in ("rollout_mismatch",) if k in doc}, sort_keys=True))
a, b = (load_file(f"{run}/reference/rollout/tp{tp}/rollout.safetensors") for tp in (1, 2))
for key in sorted(a.keys() & b.keys()):
    x, y = a[key], b[key]
    same = x.shape == y.shape and bool((x == y).all())
    delta = float((x.double() - y.double()).abs().max()) if x.shape == y.shape and x.is_floating_point() else None
    print(f"rollout TP2 vs TP1 {key}: {tuple(x.shape)} bitwise equal {same} max|delta| {delta}")
PY
  for setting in default TRITON_F32_DEFAULT=ieee; do
    timed "probe $setting" env ${setting/default/PROBE=1} TRITON_CACHE_DIR=/tmp/triton-$setting TORCHDYNAMO_DISABLE=1 \
      VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_ALLOW_INSECURE_SERIALIZATION=1 \
      python3 benchmarks/vllm_gpu_probe.py "$run/reference/models/actor" "$setting" 2>&1 \
      | grep -E "^PROBE|^== |Error|attention backend" | tail -n 6 || true
  done
  timed "qualify rounds (vLLM TP2, torch-tp TP2)" qualify rounds "$matrix" --run "$run" --vllm-tp 2 --train-tp 2 \
    --format json > "$out/rounds.json" || true
  python3 - "$out/rounds.json" <<'PY' || true
import json, sys
v = json.load(open(sys.argv[1]))
print("rounds:", "PASSED" if v["passed"] else "FAILED", f"{v['num_checks'] - v['num_failed']}/{v['num_checks']} checks,",
      v["seconds"], "s; bound", v["bound"]["logprob_max_abs"], v["bound"]["source"], "| failure:", v["failure"])
for r in v["rows"]:
    print("  ", r["round"], r["check"], "|", str(r["observed"])[:80], "|", str(r["required"])[:60], "|", r["passed"])
PY
  tar -C "$run" -czf "$out/evidence.tgz" --exclude='*.safetensors' reference/reference.json acceptance rounds \
    reference/rollout 2>/dev/null || true
  return $rc
}

slurm() {
  local out=${1:?} matrix=${2:-benchmarks/gpu-tiny-tp2.yaml} run=${3:-runs/gpu-slurm} cases=${4:-}
  install
  mkdir -p "$out"
  local debs=/tmp/bundle/slurm-debs; [ -d $debs ] || debs=$parts  # the old bundle held them; else given as a part
  eval "$(bash scripts/slurm-gpu.sh start $debs)"
  local args=(--cluster sbatch/clusters/h200x2-local.yaml --run "$run" --wait)
  [ -z "$cases" ] || args+=(--only "$cases")
  local start=$EPOCHREALTIME rc=0
  qualify sbatch "$matrix" "${args[@]}" > "$out/sbatch.out" 2> "$out/sbatch.err" &
  local pid=$! task=""
  ( sleep "${SLURM_BUDGET_S:-420}"; kill $pid 2>/dev/null && echo "stopped following after ${SLURM_BUDGET_S:-420} s" ) &
  # requeue the first candidate array task seen running, once, while it runs
  while kill -0 $pid 2>/dev/null && [ -z "$task" ]; do
    task=$(squeue -h -t R -o "%i %j" | awk '$2 ~ /-candidate-/ {print $1; exit}')
    [ -z "$task" ] && sleep 1
  done
  [ -z "$task" ] || { sleep 3; scontrol requeue "$task" && echo "requeued $task $(date +%T)"; }
  wait $pid || rc=$?
  awk -v s="$start" -v e="$EPOCHREALTIME" -v rc=$rc 'BEGIN{printf "== qualify sbatch --wait: exit %s in %.1f s\n", rc, e - s}'
  grep -v "^\s*$" "$out/sbatch.out" | tail -n 20; tail -n 20 "$out/sbatch.err"
  grep -h "qualify-slurm:" "$run"/slurm/logs/*.out | sort | uniq -c | sort -rn | head -n 40 || true
  [ -z "$task" ] || grep -l "restart 1" "$run"/slurm/logs/*.out || true
  tar -C "$run" -czf "$out/slurm-logs.tgz" slurm candidates/verdict.json rounds 2>/dev/null || true
  cp /tmp/gslurm/log/slurmctld.log "$out/" 2>/dev/null || true
  bash scripts/slurm-gpu.sh stop
  return $rc
}

chain() {  # the product path without the probe and rounds: GPU vLLM capture, reference, freeze, every case, report
  local out=${1:?} matrix=${2:-benchmarks/gpu-tiny-tp2.yaml} run=${3:-runs/gpu-tiny-tp2}
  install
  [ -e .whl ] || [ ! -d /tmp/bundle/.whl ] || ln -s /tmp/bundle/.whl .whl
  versions
  mkdir -p "$out"
  local start=$EPOCHREALTIME rc=0
  # one reference stage: the capture (its own log line) and the scoring in one process
  bash benchmarks/gpu_chain.sh "$out" "$matrix" "$run" || rc=$?
  awk -v s="$start" -v e="$EPOCHREALTIME" 'BEGIN{printf "== capture to report: %.1f s\n", e - s}' | tee -a "$out/stages.md"
  [ -z "${REPORT_JSON:-}" ] || qualify report "$run" --format json > "$out/report.json" 2>/dev/null || true
  return $rc
}

exact() {  # the tiny family's bf16 T = 1 rollout with vLLM's batch-invariant mode on and off, torch-tp's
           # rollout and layout rows, and the count after each weight sync (qualify rounds)
  local out=${1:?} m
  install
  versions
  mkdir -p "$out"
  timed "the exact engine's kernels" python3 benchmarks/exact_gpu_smoke.py || return 1
  for m in ${EXACT_MATRICES:-gpu-tiny-exact gpu-tiny-exact-off}; do
    local run=/tmp/$m
    timed "$m: reference (GPU vLLM capture, HF on the GPU)" qualify reference benchmarks/$m.yaml --run $run || continue
    timed "$m: freeze" qualify freeze $run || continue
    timed "$m: candidate" qualify candidate benchmarks/$m.yaml --run $run > "$out/$m-candidate.txt" || true
    timed "$m: rounds" qualify rounds benchmarks/$m.yaml --run $run --format json > "$out/$m-rounds.json" || true
    python3 benchmarks/exact_rows.py $run "$out/$m-rounds.json" | tee "$out/$m-counts.txt" || true
    grep -h batch_invariant -A6 $run/reference/rollout/tp1/rollout.json | head -n 12 || true
  done
}

case ${1:-} in
  chain) shift; chain "$@" ;;
  exact) shift; exact "$@" ;;
  install) install; versions ;;  # the site alone (before a probe that needs GPU vLLM)
  part) mkdir -p $parts && cp "$here/${2:?}"/* $parts/ && ls -l $parts && df -h /tmp | tail -n 1 ;;
  run) shift; run "$@" ;;
  slurm) shift; slurm "$@" ;;
  *) echo "usage: gpu_vllm_chain.sh part DIR | install | run OUT [MATRIX] [RUN] | chain OUT [MATRIX] [RUN] | exact OUT | slurm OUT [MATRIX] [RUN] [CASES]" >&2
     exit 2 ;;
esac
