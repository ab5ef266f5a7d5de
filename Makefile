# Two entry points a person needs: `make demo` (set up, then run the whole chain on the embedded
# default) and `make test` (set up, then run the test suite). Both create .venv when it is missing.
VENV ?= .venv
BIN := $(VENV)/bin
MATRIX ?= matrices/tiny-qwen3.yaml
RUN ?= runs/tiny-qwen3
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export TORCHDYNAMO_DISABLE ?= 1

GPU_MATRIX ?= benchmarks/gpu-qwen3-0.6b-1gpu.yaml
GPU_RUN ?= runs/qwen3-0.6b-1gpu
GPU_PYTHON ?= python3
WHEELHOUSE ?=

.PHONY: demo demo-gpu test test-extended env lint lock mutation

$(VENV)/.installed: requirements/cpu.lock requirements/test.lock pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)

env: $(VENV)/.installed

demo: $(VENV)/.installed
	bash scripts/demo.sh $(MATRIX) $(RUN)

# On a CUDA host: install the GPU stack into its own Python from requirements/gpu.lock (WHEELHOUSE=DIR: offline, from
# wheels laid out beforehand), then the main job on the Qwen3-0.6B-shaped family, GPU vLLM capturing the rollout.
demo-gpu:
	PYTHON=$(GPU_PYTHON) bash scripts/install-gpu.sh $(if $(WHEELHOUSE),--wheelhouse $(WHEELHOUSE))
	VLLM_USE_FLASHINFER_SAMPLER=0 QUALIFY="$(GPU_PYTHON) -m qualify" LAUNCHES=$${LAUNCHES:-2} \
	  bash scripts/demo.sh $(GPU_MATRIX) $(GPU_RUN)

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q --durations=30 $(PYTEST_ARGS)

# The suite and the extended sweeps (pytest.mark.extended: wide passes of correct engines whose representatives the
# suite runs; TESTING.md, 'The extended sweeps').
test-extended: $(VENV)/.installed
	QUALIFY_EXTENDED=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(BIN)/ruff check qualify tests benchmarks

# Mutation testing of the judging core (mutmut; settings in pyproject's [tool.mutmut]; TESTING.md has the scores).
# It works on a fresh copy of the working tree in $(MUTATION_DIR)/tree (mutmut writes mutants/ beside the sources
# and re-copies only the mutated modules, so a copy is never reused), with one worker and one thread.
# MUTANTS narrows it: make mutation MUTANTS='qualify.freeze*'. Not run in CI (one to two hours on 2 cores).
# MUTATION_TIMEOUT is mutmut's timeout_constant (seconds added to a mutant's estimated test time before its x15
# wall limit), set in the copy's pyproject: mutmut's 1 s reported unchanged mutants as timeouts on shared cores.
MUTATION_DIR ?= /tmp/qualify-mutation
MUTANTS ?=
MUTATION_TIMEOUT ?= 10
# MUTATION_REV=HEAD (any commit) copies that commit instead of the working tree: a score that names its commit.
MUTATION_REV ?=
# MUTATION_ALSO='qualify/hashing.py' adds modules to the copy's only_mutate (with MUTANTS='qualify.hashing*').
MUTATION_ALSO ?=
mutation: $(VENV)/.installed
	rm -rf $(MUTATION_DIR)/tree && mkdir -p $(MUTATION_DIR)/tree
	$(if $(MUTATION_REV),git archive $(MUTATION_REV),git ls-files -z --cached --others --exclude-standard \
	  | tar --null --ignore-failed-read -T - -c) | tar -x -C $(MUTATION_DIR)/tree
	sed -i 's/^\[tool\.mutmut\]$$/&\ntimeout_constant = $(MUTATION_TIMEOUT)/' $(MUTATION_DIR)/tree/pyproject.toml
	$(if $(MUTATION_ALSO),sed -i 's|^only_mutate = \[|&$(foreach f,$(MUTATION_ALSO),"$(f)", )|' $(MUTATION_DIR)/tree/pyproject.toml)
	cd $(MUTATION_DIR)/tree && OMP_NUM_THREADS=1 $(abspath $(BIN))/mutmut run --max-children 1 $(MUTANTS) \
	  >../mutmut-run.log 2>&1 || { tail -c 2000 ../mutmut-run.log; exit 1; }
	cd $(MUTATION_DIR)/tree && $(abspath $(BIN))/mutmut results --all true | awk -F'[ :]+' '{ \
	  m = $$2; sub(/__mutmut_[0-9]+$$/, "", m); sub(/\.[^.]*$$/, "", m); n[m]++; s[m, $$3]++ } END { \
	  for (m in n) printf "%-28s %4d mutants %4d killed %3d survived %3d no tests %3d timeout\n", m, n[m], \
	    s[m, "killed"], s[m, "survived"], s[m, "no"], s[m, "timeout"] }' | sort
