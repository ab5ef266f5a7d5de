#!/bin/bash
# {{ title }}
# Rendered by `qualify sbatch` from {{ matrix }} and {{ profile }}: render again, do not edit.
{{ directives }}
set -euo pipefail

# Exported before any process starts: cuBLAS, NCCL and vLLM read these once, at initialization.
{{ exports }}

# Environment activation.
{{ environment }}

# Provenance: the stages read these and record them in their evidence.
export SLURM_JOB_ID SLURM_JOB_NAME SLURM_ARRAY_JOB_ID SLURM_ARRAY_TASK_ID SLURM_JOB_NODELIST SLURM_RESTART_COUNT
export CUDA_VISIBLE_DEVICES
echo "qualify-slurm: {{ stage }} job ${SLURM_JOB_ID} array ${SLURM_ARRAY_JOB_ID:-none}_${SLURM_ARRAY_TASK_ID:-none}" \
  "restart ${SLURM_RESTART_COUNT:-0} nodes ${SLURM_JOB_NODELIST} gpus ${CUDA_VISIBLE_DEVICES:-none} host $(hostname)"

# The cases and resources below were rendered from this matrix: refuse to run on an edited one.
if [ "$(sha256sum < {{ matrix }} | cut -d ' ' -f 1)" != {{ matrix_sha256 }} ]; then
  echo "qualify-slurm: {{ matrix }} is missing or changed since these scripts were rendered; render them again" >&2
  exit 2
fi
