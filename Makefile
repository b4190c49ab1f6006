# `make demo` and `make test` do all set-up themselves on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE ?= 1

.PHONY: demo study test test-quick bench comm-volume tables gpu-check clean

# the library requires ranges (pyproject.toml); the checkout installs the exact versions it is tested with
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[all]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m cifar10.demo

# the paper's two comparisons in kind (digits / ResNet-8, BERT validation MLM loss), seeds and intervals,
# into results/study/; not part of `make test`
study: $(STAMP)
	$(PY) scripts/study.py

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# the quick tier: no worker processes, no end-to-end pipeline runs
test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not multiprocess and not e2e" $(PYTEST_ARGS)

# the GPU acceptance check (results/gpu/<gpu>.md); one line and exit 0 without CUDA. `make gpu-check PY=python3`
# runs it with an interpreter that already has torch (no venv made)
gpu-check: $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))
	$(PY) -m bench.gpu_check

bench: $(STAMP)
	$(PY) -m bench.optimizer_step

comm-volume: $(STAMP)
	$(PY) -m bench.comm_volume

tables: $(STAMP)
	$(PY) scripts/make_tables.py --runs runs --out results

clean:
	rm -rf $(VENV) .pytest_cache
