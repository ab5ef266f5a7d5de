#!/usr/bin/env bash
# The main job: reference -> freeze -> candidate -> verify -> report (terminal, HTML, JUnit) on a matrix (default: the
# embedded tiny Qwen3). Every stage resumes: rerunning skips what is complete and verified.
set -uo pipefail
matrix=${1:-matrices/tiny-qwen3.yaml}
run=${2:-runs/tiny-qwen3}
# QUALIFY: how to run qualify (default the venv's command; `python3 -m qualify` on a CUDA host's own Python)
read -ra q <<< "${QUALIFY:-.venv/bin/qualify}"
# LAUNCHES: launch groups at once in the candidate stage (on a GPU they share it within its memory: see README)
launches=${LAUNCHES:-1}
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0} TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
start=$(date +%s)
step() { echo; echo "== $*"; "$@"; }
step "${q[@]}" reference "$matrix" --run "$run" || exit $?
step "${q[@]}" freeze "$run" || exit $?
step "${q[@]}" candidate "$matrix" --run "$run" --launches "$launches"; verdict=$?
[ "$verdict" -le 1 ] || exit "$verdict"
step "${q[@]}" verify "$run/acceptance/acceptance.json" || exit $?
step "${q[@]}" report "$run"; report=$?
# The same verified summary as a self-contained HTML page (plots inline) and as JUnit XML for CI.
step "${q[@]}" report "$run" --format html --out "$run/report.html"
step "${q[@]}" report "$run" --format junit --out "$run/junit.xml"
echo
echo "main job finished in $(( $(date +%s) - start )) s: candidates $([ "$verdict" -eq 0 ] && echo PASSED || echo FAILED)"
echo "HTML report: $run/report.html  JUnit: $run/junit.xml"
[ "$report" -le 1 ] || exit "$report"
# the report exits 1 when the evidence does not verify, even where the candidate stage passed
[ "$verdict" -ne 0 ] && exit "$verdict"
exit "$report"
