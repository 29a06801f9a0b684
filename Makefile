# orin_vlm_node — the two commands of the README (`make demo`, `make test`) and the benchmarks.
# Everything installs into .venv from the pinned requirement files; nothing needs a manual step.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
REQS := requirements.txt requirements-ros.txt requirements-test.txt
STAMP := $(VENV)/.installed
LINT_PATHS := orin_vlm_node support test tools bench launch setup.py

# Every process started from here that touches ROS discovers peers on this machine only.
export ROS_AUTOMATIC_DISCOVERY_RANGE := LOCALHOST
export ROS_DOMAIN_ID ?= 77
export PYTHONUNBUFFERED := 1

# The GPU check (see bench/gpu_check.py): gpu-wheels runs where a package index is reachable and fills
# $(GPU_WHEELS_DIR) with what a bare CUDA machine lacks (keeping the PyCUDA archive an earlier gpu-check
# built); gpu-check runs there with its own python3 (torch).
# For a Jetson with JetPack 6: make gpu-wheels GPU_PY_VERSION=3.10 GPU_ARCH=aarch64.
GPU_PYTHON ?= python3
GPU_PY_VERSION ?= 3.12
GPU_ARCH ?= x86_64
GPU_PLATFORMS ?= $(addsuffix _$(GPU_ARCH),manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014)
GPU_WHEELS_DIR ?= .gpu-wheels
GPU_BIG_CONFIG ?= ../shared/model-configs/Qwen3-VL-2B-Instruct.config.json
PYCUDA_VERSION := 2026.1
# PyCUDA's dependencies and the parity reference, pinned per Python of the GPU machine: on 3.10 (JetPack 6)
# platformdirs stops at 4.12 and transformers at 5.20 (which has Qwen3-VL as the parity check uses it).
# deps/ gets what transformers needs (tokenizers, huggingface_hub, ...): a bare machine with only torch
# lacks them, and gpu-check installs those of them the machine does not have.
GPU_WHEELS_DEFAULT := pytools==2026.1.1 platformdirs==4.14.7 mako==1.4.3 siphash24==1.9 transformers==5.23.0
GPU_WHEELS_3.10 := pytools==2026.1.1 platformdirs==4.12.4 mako==1.4.3 siphash24==1.9 transformers==5.20.2
GPU_WHEELS ?= $(or $(GPU_WHEELS_$(GPU_PY_VERSION)),$(GPU_WHEELS_DEFAULT))

.PHONY: venv install test lint demo bench bench-quick vllm-env vllm-server gpu-wheels gpu-check clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Re-runs pip only when a requirement file changed, so a second `make test` starts in seconds.
$(STAMP): $(REQS) | $(VENV)/bin/python
	$(PY) -m pip install --disable-pip-version-check -q $(addprefix -r ,$(REQS))
	touch $@

venv: $(STAMP)

# Installs the package itself (non-editable) so tests run the real entry point and share/ files.
install: venv
	$(PY) -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation .

# Settings in pyproject.toml; formatting is checked as strictly as the rules.
lint: venv
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

# pytest exits 5 when it collected nothing: that is a failure here, never a pass.
# The suite runs on every core (pytest-xdist), a test file a worker, so a file's module fixtures (the nvcc
# builds, the node a ROS module starts) are made once, the files in collection order (conftest.py puts the
# longest first); TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= auto
test: lint install
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

demo: install
	$(PY) -m tools.demo

bench: install
	$(PY) -m bench.run

bench-quick: install
	$(PY) -m bench.run --quick

# A real vLLM on this machine's CPU serving the default model (the remote backend's peer, see
# support/vllm_server.py): vllm-env builds its environment once (~6 GB, outside the clone; the tests of the
# remote backend against vLLM run where it exists), vllm-server serves on 127.0.0.1:8000 until Ctrl-C.
vllm-env: install
	$(PY) -m support.vllm_server --env-only

vllm-server: install
	$(PY) -m support.vllm_server

gpu-wheels: venv
	@test -f $(GPU_BIG_CONFIG) || { echo "gpu-wheels: $(GPU_BIG_CONFIG) not found (set GPU_BIG_CONFIG to a Qwen3-VL-2B config.json)" >&2; exit 1; }
	mkdir -p $(GPU_WHEELS_DIR) && find $(GPU_WHEELS_DIR) -mindepth 1 -maxdepth 1 ! -name 'pycuda-built-*.tgz' -exec rm -rf {} +
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --no-binary=:all: --no-build-isolation \
		-d $(GPU_WHEELS_DIR) pycuda==$(PYCUDA_VERSION)
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version $(GPU_PY_VERSION) --implementation cp $(addprefix --platform ,$(GPU_PLATFORMS)) \
		-d $(GPU_WHEELS_DIR) $(GPU_WHEELS)
	$(PY) -m pip download -q --disable-pip-version-check --only-binary=:all: \
		--python-version $(GPU_PY_VERSION) --implementation cp $(addprefix --platform ,$(GPU_PLATFORMS)) \
		-d $(GPU_WHEELS_DIR)/deps $(filter transformers==%,$(GPU_WHEELS))
	rm -f $(GPU_WHEELS_DIR)/deps/transformers-*.whl
	install -m 0644 $(GPU_BIG_CONFIG) $(GPU_WHEELS_DIR)/Qwen3-VL-2B-Instruct.config.json
	@ls -l $(GPU_WHEELS_DIR)

# GPU_CHECK_ARGS: more options, e.g. GPU_CHECK_ARGS="--bench-parts kernels,decode.fp16 --budget-s 300".
gpu-check:
	$(GPU_PYTHON) -m bench.gpu_check --wheels $(GPU_WHEELS_DIR) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info gpu-check-out
