# Two entry points a person needs: `make demo` (set up, then run the whole chain on the embedded
# default) and `make test` (set up, then run the test suite). Both create .venv when it is missing.
VENV ?= .venv
BIN := $(VENV)/bin
MATRIX ?= matrices/tiny-qwen3.yaml
RUN ?= runs/tiny-qwen3
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export TORCHDYNAMO_DISABLE ?= 1

.PHONY: demo test env lint lock

$(VENV)/.installed: requirements/cpu.lock requirements/test.lock pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)

env: $(VENV)/.installed

demo: $(VENV)/.installed
	bash scripts/demo.sh $(MATRIX) $(RUN)

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(BIN)/ruff check qualify tests benchmarks
