# `make test` and `make demo` both start from nothing: they create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The dev setup pins torch (a CPU build on our machines) and the triton whose interpreter runs the kernels in CI.
TORCH_PIN := torch==2.13.0
TRITON_PIN := triton==3.9.0
STAMP := $(VENV)/.installed
# Two workers match CI's two cores; the Triton interpreter is single-threaded.
TEST_WORKERS ?= 2

.PHONY: setup test demo lint clean gpu-quick

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN) $(TRITON_PIN)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -q

demo: setup
	$(BIN)/llm-speed demo

# The quick GPU proof (budget 100 s; not yet timed on a GPU): versions, doctor, ~30 GPU tests -> GPU_OUT.
# Uses $(PYTHON) as is (the GPU machine's own torch), not the CPU venv.
GPU_OUT ?= gpu-quick-out
gpu-quick:
	PYTHON=$(PYTHON) bash benchmarks/run_gpu_suite.sh quick $(GPU_OUT)

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
