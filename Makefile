# `make demo` and `make test` do all set-up themselves on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE ?= 1

.PHONY: demo study study-tune sweeps time-to-accuracy test test-quick test-compat test-newest bench comm-volume tables \
        gpu-check clean

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

# AdamW's and LAMB's learning rates chosen on a validation split held out of the digits' training images (a grid
# of 5 rates x 2 seeds each, extended past an edge that wins), into results/study/runs/tune/ and the study's page
# (about 25 minutes on 2 cores; then the AdamW row's lr to the choice and `make study`, docs/study.md)
study-tune: $(STAMP)
	$(PY) scripts/study.py --tune

# SLAMB's beta3 x k grid and its H line on the study's digits recipe, 2 seeds each, beside LAMB's runs of the
# same recipe, through the user's own sweep scripts; pages into results/sweeps/ (about 45 minutes on 2 cores), the
# runs' records kept in results/sweeps/runs/ (the pages again: scripts/make_tables.py --runs results/sweeps/runs
# --out results/sweeps)
SWEEPS := RUNS=runs/sweeps TABLES=results/sweeps EXPERIMENT=study/digits_slamb_v1
SWEEP_DATA := data.dir=runs/sweeps/data/digits-cifar10-layout
sweeps: $(STAMP)
	$(PY) -m cifar10.data --write-digits runs/sweeps/data/digits-cifar10-layout
	$(PY) -m cifar10.train --multirun experiment=study/digits_lamb seed=0,1 $(SWEEP_DATA)
	$(SWEEPS) GRID=1 scripts/sweep_compress_ratio.sh seed=0,1 $(SWEEP_DATA)
	$(SWEEPS) scripts/sweep_sync_interval.sh seed=0,1 $(SWEEP_DATA)
	$(PY) scripts/make_tables.py --runs runs/sweeps --keep results/sweeps/runs --out results/sweeps

# the speed claim: LAMB, SLAMB (H 10, int8, H 50) and 1-bit LAMB to accuracy on 2 and 4 emulated hosts behind a
# 5 Mbit/s link, 6 seeds (needs root for the network namespaces); results/time_to_accuracy.md and .json (60 runs,
# about 3.5 hours on a quiet 2-core machine)
time-to-accuracy: $(STAMP)
	$(PY) -m bench.time_to_accuracy

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# the quick tier: no worker processes, no end-to-end pipeline runs
test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not multiprocess and not e2e" $(PYTEST_ARGS)

# the torch releases at the ends of the range pyproject.toml declares, each in a venv of its own, with what a GPU
# machine's tier-1 check has besides (pytest, transformers, omegaconf), the other packages at constraints.txt's
# versions: the tests that reach into torch (its compiler, FSDP2/HSDP, DCP, collectives, dispatch, profiler) and the
# GPU check's plumbing. test-compat: the oldest (PyPI's only torch 2.11 for Linux is the CUDA build: about 1.7 GB to
# download once, 4.7 GB installed). test-newest: the newest release, what `pip install slamb` brings today (PyPI's
# CUDA build too: about 1.9 GB to download, estimated from its 5.6 GB installed; 8 min 33 s to build cold). Not a
# step of .ci/run: a cold CI run is to stay under 60 minutes and takes about 65 with make test and test-compat, to
# which test-newest would add about 19 (the build, then its tests: 10 min 52 s in the warm venv, 106 passed and 65
# CUDA-only skipped, then 59 with workers; 2 cores shared with another test run)
TORCH_OLDEST  := 2.11.0
TORCH_NEWEST  := 2.15.0
# by the venv's suffix: the rules below serve both venvs
TORCH_compat  := $(TORCH_OLDEST)
TORCH_newest  := $(TORCH_NEWEST)
COMPAT        := .venv-compat
NEWEST        := .venv-newest
COMPAT_TESTS  := tests/test_fused.py tests/test_precision.py tests/test_gpu_paths.py tests/test_masks.py \
                 tests/test_kernels.py tests/test_comm.py tests/test_gpu.py
# and with workers: FSDP2/HSDP and DCP (each module's tests read one run of its workers), the collectives on 3
# ranks, the GPU check run as a command
COMPAT_WORKERS := tests/test_fsdp.py tests/test_fsdp_checkpoint.py tests/test_gpu_check.py \
                  tests/test_comm.py::test_collectives_and_their_bytes_on_three_ranks

# the venv's constraint file replaces any a pip configuration names (PIP_CONSTRAINT overrides the configuration's
# `constraint`, which -c would only add to; an empty value is ignored): where a pip configuration constrains torch
# to another release, the venv's torch pin could not be met
$(COMPAT)/.installed $(NEWEST)/.installed: .venv-%/.installed: pyproject.toml constraints.txt
	test -x .venv-$*/bin/python || $(PYTHON) -m venv .venv-$*
	{ grep -v -E '^(torch|triton|nvidia-|cuda-)' constraints.txt; echo torch==$(TORCH_$*); } > .venv-$*/constraints.txt
	PIP_CONSTRAINT=.venv-$*/constraints.txt .venv-$*/bin/python -m pip install -q -e . pytest transformers omegaconf
	touch $@

test-compat test-newest: test-%: .venv-%/.installed
	.venv-$*/bin/python -m pytest -q -m "not multiprocess" $(COMPAT_TESTS) $(PYTEST_ARGS)
	.venv-$*/bin/python -m pytest -q $(COMPAT_WORKERS) $(PYTEST_ARGS)

# the GPU acceptance check (docs/gpu.md; results/gpu/<gpu>.md): tier 1, at most 5 minutes on one H100; TIER=2 the
# rest. Without CUDA it runs its environment part and skips the others, a line each. `make gpu-check PY=python3`
# runs it with an interpreter that already has torch (no venv made)
TIER ?= 1
gpu-check: $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))
	$(PY) -m bench.gpu_check --tier $(TIER)

bench: $(STAMP)
	$(PY) -m bench.optimizer_step

comm-volume: $(STAMP)
	$(PY) -m bench.comm_volume

# the tables of the runs under RUNS into TABLES; results/ takes only runs at their recipe's size. `make tables
# PY=python3` renders them with an interpreter that already has the packages (no venv made)
RUNS   ?= runs
TABLES ?= results
tables: $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))
	$(PY) scripts/make_tables.py --runs $(RUNS) --out $(TABLES)

clean:
	rm -rf $(VENV) $(COMPAT) $(NEWEST) .pytest_cache
