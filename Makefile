# train-ledger: `make demo` and `make test` both build .venv from nothing.
SHELL := /bin/bash
# Python 3.12 (megatron-core 0.18 needs it): pyenv's if there is one, else python3.12 on PATH
PYTHON312 ?= $(firstword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python $(HOME)/.pyenv/versions/3.12*/bin/python /root/.pyenv/versions/3.12*/bin/python) $(shell command -v python3.12))
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast clean slurm-up slurm-down

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x "$(PYTHON312)" || { echo "Python 3.12 not found (megatron-core 0.18 needs >= 3.12): set PYTHON312=" >&2; exit 1; }
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	# torch first: the CUDA build of 2.13.0 (runs on the CPU; brings triton, which megatron-core and torchtitan import)
	$(PIP) install -q --no-compile torch==2.13.0 numpy
	# deepspeed is an sdist: build it against that torch, pure Python (no CUDA/C++ ops at install)
	DS_BUILD_OPS=0 $(PIP) install -q --no-compile --no-build-isolation deepspeed==0.19.8
	$(PIP) install -q --no-compile -e .
	# the bytecode pip would write one file at a time, on every core at once (~30 s less of the install
	# here); written now, as a process that imports with PYTHONDONTWRITEBYTECODE=1 never writes it
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null
	$(PIP) check
	touch $(STAMP)

# one sweep dir per `make demo`; the report (HTML + PNGs) goes to $(DEMO_DIR)/report/index.html
DEMO_DIR := multirun/demo-$(shell date +%Y%m%d-%H%M%S)

demo: $(STAMP)
	WANDB_MODE=offline $(PY) launch.py -m framework=megatron,deepspeed,titan hydra.sweep.dir=$(DEMO_DIR)
	$(PY) -m analysis.report $(DEMO_DIR)

# two pytest-xdist workers, one test file each at a time (a module's real run stays one fixture):
# while one worker's ranks compute, the other's single-process tests, Slurm waits and time limits
# use the second core. PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2
test: $(STAMP)
	WANDB_MODE=offline $(PY) -m pytest -q --durations=15 $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder) tests

test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not real and not slurm"

clean:
	rm -rf $(VENV) multirun outputs

slurm-up:
	bash scripts/slurm.sh up

slurm-down:
	bash scripts/slurm.sh down
