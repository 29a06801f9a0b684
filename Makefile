# orin_vlm_node — the two commands of the README (`make demo`, `make test`) and the benchmarks.
# Everything installs into .venv from the pinned requirement files; nothing needs a manual step.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
REQS := requirements.txt requirements-ros.txt requirements-test.txt
STAMP := $(VENV)/.installed
RUFF_FLAGS := --line-length 120 --target-version py310 --select E,F,W,I,B,UP
LINT_PATHS := orin_vlm_node test tools bench launch setup.py

# Every process started from here that touches ROS discovers peers on this machine only.
export ROS_AUTOMATIC_DISCOVERY_RANGE := LOCALHOST
export ROS_DOMAIN_ID ?= 77
export PYTHONUNBUFFERED := 1

.PHONY: venv install test lint demo bench bench-quick clean

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

lint: venv
	$(VENV)/bin/ruff check $(RUFF_FLAGS) $(LINT_PATHS)

# pytest exits 5 when it collected nothing: that is a failure here, never a pass.
test: lint install
	@$(PY) -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

demo: install
	$(PY) tools/demo.py

bench: install
	$(PY) bench/run.py

bench-quick: install
	$(PY) bench/run.py --quick

clean:
	rm -rf $(VENV) build *.egg-info
