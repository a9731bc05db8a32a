# `make test` and `make demo` both start from nothing: they create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The dev setup pins torch (a CPU build on our machines) and the triton whose interpreter runs the kernels in CI.
TORCH_PIN := torch==2.13.0
TRITON_PIN := triton==3.9.0
STAMP := $(VENV)/.installed
# The GPU machine's Triton (torch 2.11's pin), unpacked beside the venv: the compile checks and an interpreter
# run of every op also use it (tests/triton_builds.py), so a kernel only it refuses fails here, not on the GPU.
TRITON_GPU_PIN := triton==3.6.0
TRITON_GPU_DIR := .cache/triton-3.6.0
TRITON_GPU_STAMP := $(TRITON_GPU_DIR)/.installed
# Two workers match CI's two cores; the Triton interpreter is single-threaded.
TEST_WORKERS ?= 2
# Byte code is written by a module's first import and read by every later process. An environment that sets
# PYTHONDONTWRITEBYTECODE (container images often do) writes none, and each of the suite's hundreds of Python
# processes compiled torch's modules again: 2.4 s of CPU a process. The suite writes its byte code under
# .cache/pycache (not beside the sources), whatever that variable says.
PYCACHE := $(CURDIR)/.cache/pycache
TEST_ENV := PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(PYCACHE)

.PHONY: setup test demo lint clean gpu-quick gpu-proof test-gpu-stack triton-cache

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# --no-compile: modules are byte-compiled when first imported (a few hundred) instead of all at install
	# (torch's and transformers' thousands: ~15 s of CPU in each set-up)
	$(BIN)/python -m pip install --quiet --no-compile $(TORCH_PIN) $(TRITON_PIN)
	$(BIN)/python -m pip install --quiet --no-compile -e ".[dev]"
	touch $(STAMP)

$(TRITON_GPU_STAMP): Makefile | $(STAMP)
	rm -rf $(TRITON_GPU_DIR)
	$(BIN)/python -m pip install --quiet --no-deps --target $(TRITON_GPU_DIR) $(TRITON_GPU_PIN)
	touch $(TRITON_GPU_STAMP)

test: setup $(TRITON_GPU_STAMP)
	# the byte code of the last run's temporary files (its tests' scripts, the wheel's fresh venv) is not kept
	rm -rf "$(PYCACHE)$$($(BIN)/python -c 'import tempfile; print(tempfile.gettempdir())')"
	$(TEST_ENV) LLM_SPEED_TRITON_GPU=$(CURDIR)/$(TRITON_GPU_DIR) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -q

demo: setup
	$(BIN)/llm-speed demo

# The quick GPU proof (budget 150 s; on the first H100 run, cold, its tests had not finished in 85 s):
# versions, doctor, ~30 GPU tests -> GPU_OUT.
# Uses $(PYTHON) as is (the GPU machine's own torch), not the CPU venv.
GPU_OUT ?= $(or $(OUT),gpu-quick-out)
gpu-quick:
	PYTHON=$(PYTHON) bash benchmarks/run_gpu_suite.sh quick $(GPU_OUT)

# The one-lease proof (budget 480 s, issue 70): every family and candidate launch choice against float64,
# the headline rows, the A/B with the time left -> GPU_PROOF_OUT (summary.txt, summary.json, results.tar.gz).
# On the device machine $OUT is the folder that comes back: the default there.
GPU_PROOF_OUT ?= $(or $(OUT),gpu-proof-out)
gpu-proof:
	PYTHON=$(PYTHON) bash benchmarks/run_gpu_suite.sh proof $(GPU_PROOF_OUT)

# The whole suite on the GPU machine's software (torch 2.11, its CUDA build from PyPI, about 3 GB; Triton 3.6;
# Python 3.12 where there is one) on the CPU, in its own venv: API drift between torch 2.11 and the dev pin shows
# here, not in a lease. Not part of `make test` (6 minutes on 2 idle cores). numpy < 2.4: Triton 3.6's interpreter
# fails on a runtime loop bound with numpy 2.4.
GPU_STACK_VENV ?= .venv-gpu-stack
GPU_STACK_PINS ?= torch==2.11.0 triton==3.6.0 "numpy<2.4"  # another stack: GPU_STACK_PINS="torch==2.13.0"
GPU_STACK_PYTHON ?= $(shell python3.12 -c 1 >/dev/null 2>&1 && echo python3.12 || echo $(PYTHON))
GPU_STACK_TESTS ?=  # pytest arguments (files, -k ...); default the whole suite
test-gpu-stack:
	test -x $(GPU_STACK_VENV)/bin/python || $(GPU_STACK_PYTHON) -m venv $(GPU_STACK_VENV)
	$(GPU_STACK_VENV)/bin/python -m pip install --quiet --no-compile $(GPU_STACK_PINS)
	$(GPU_STACK_VENV)/bin/python -m pip install --quiet --no-compile -e ".[dev]"
	$(GPU_STACK_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -q -p no:cacheprovider $(GPU_STACK_TESTS)

# A Triton cache for the proof (issue 70, item 2), compiled here by the GPU machine's Python, torch and Triton
# (3.12, 2.11, 3.6: a cache key hashes Triton's libtriton.so, which differs per Python) into
# .cache/triton-carry/ (git-ignored: carry it with the device command, beside .whl); the proof unpacks it and
# its summary says how many kernels it served. ~8 min on 2 cores (526 kernels, 22.4 MiB: the report's, then the
# proof's own headline and A/B calls, benchmarks/proof_problems.py; ~13 GB of memory at most), after the first
# run's download of torch's CUDA build from PyPI (about 3 GB). transformers as the GPU machine's 5.17.0: the
# train step's model makes the calls whose kernels are captured.
CACHE_VENV ?= .venv-cp312
CACHE_PYTHON ?= $(shell python3.12 -c 1 >/dev/null 2>&1 && echo python3.12 || (test -x $(HOME)/.pyenv/versions/3.12.1/bin/python3.12 && echo $(HOME)/.pyenv/versions/3.12.1/bin/python3.12) || echo python3.12)
CACHE_PINS ?= torch==2.11.0 triton==3.6.0 "numpy<2.4" transformers==5.17.0
triton-cache:
	test -x $(CACHE_VENV)/bin/python || $(CACHE_PYTHON) -m venv $(CACHE_VENV)
	$(CACHE_VENV)/bin/python -m pip install --quiet --no-compile $(CACHE_PINS)
	$(CACHE_VENV)/bin/python -m pip install --quiet --no-compile -e .
	$(CACHE_VENV)/bin/python benchmarks/triton_cache.py build .cache/triton-carry/h100-sxm.tar.gz --gpu h100-sxm \
		--workers $(TEST_WORKERS)

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(GPU_STACK_VENV) $(CACHE_VENV) .cache build *.egg-info src/*.egg-info
