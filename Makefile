# The two commands of the README: `make run` and `make test` (both set up .venv when needed).
PY        := .venv/bin/python
TORCHRUN  := .venv/bin/torchrun --standalone --local-ranks-filter 0
# Two cores: one thread per rank keeps 2-4 gloo ranks from fighting over them.
export OMP_NUM_THREADS ?= 1

# (test-mcore-0.20*: the 0.20 lane, below)
.PHONY: test-mcore-0.20 test-mcore-0.20-env test-mcore-0.20-sessions test-mcore-0.20-runs test-functional-lane
.PHONY: setup run demo lint mypy test test-upstream-cases test-single test-unit test-functional test-lanes test-2ranks test-4ranks test-install test-gpu-prep test-gpu test-multinode test-soak wheelhouse doctor clean

setup:
	@scripts/bootstrap.sh

# The mHC hybrid recipe (TP2 x PP2, MTP) on 4 CPU ranks through megatron.training.pretrain:
# one line per iteration, then runs/<name>-cpu-<time>/ with metrics, loss.png and the golden check.
run: setup
	.venv/bin/megatron-ext run recipes/hybrid_mhc_tp2_pp2_mtp.yaml

# The first demo: a tiny GPT, PP=2 on 2 CPU ranks.
demo: setup
	$(PY) -m megatron_ext.launch.demo

# Two lanes side by side (make -j2; each target's output is printed whole when it ends):
# the end-to-end runs of tests/functional_tests keep about 1.3 of the 2 cores busy (ranks wait
# on each other and on the launcher), and the lint and unit tests fill the rest. The unit lane runs
# one process, then one pytest session per rank under torchrun: each session runs the tests
# marked for its world size (tests/conftest.py); then the wheel and the GPU preparation. The
# lint (ruff, mypy) opens that lane.
# make test builds the megatron-core 0.20 environment first; the 0.20 lane's steps
# (scripts/mcore_020_lane.sh) are shared out so the two lanes end together: its four recipes and
# 4-rank session after the functional runs, its single-process and 2-rank sessions in the unit lane.
# To save time the 0.20 multi-rank sessions run each test function's first case and the
# recipes train once each against their golden values (make test-mcore-0.20 runs them whole).
test: setup
	@$(MAKE) --no-print-directory test-mcore-0.20-env
	$(MAKE) --no-print-directory -j2 --output-sync=target test-functional-lane test-lanes

test-functional-lane:
	@$(MAKE) --no-print-directory test-functional
	@$(MCORE020) recipes --once
	@$(MCORE020) 4ranks --one-case-per-test

test-lanes:
	@$(MAKE) --no-print-directory lint
	@$(MAKE) --no-print-directory test-unit
	@$(MAKE) --no-print-directory test-2ranks
	@$(MAKE) --no-print-directory test-4ranks
	@$(MCORE020) unit
	@$(MCORE020) 2ranks --one-case-per-test
	@$(MAKE) --no-print-directory test-install
	@$(MAKE) --no-print-directory test-gpu-prep

# megatron-ext on megatron-core 0.20 (scripts/mcore_020_lane.sh): .venv-mcore-0.20/ holds the wheel
# MEGATRON_CORE_WHEEL names (default ../shared/wheels/megatron-core-0.20-mhc-pp/, Megatron-LM
# #4946) and megatron-ext, on .venv's torch; there the unit sessions (1, 2 and 4 ranks) and four
# recipes against their golden values. Without a wheel: one line, and success.
MCORE020 := scripts/mcore_020_lane.sh
test-mcore-0.20: setup
	@$(MAKE) --no-print-directory test-mcore-0.20-env
	@$(MAKE) --no-print-directory test-mcore-0.20-sessions
	@$(MAKE) --no-print-directory test-mcore-0.20-runs

test-mcore-0.20-env:
	@$(MCORE020) env

test-mcore-0.20-sessions:
	@$(MCORE020) unit
	@$(MCORE020) 2ranks

test-mcore-0.20-runs:
	@$(MCORE020) 4ranks
	@$(MCORE020) recipes

# ruff and mypy (configured in pyproject.toml): the tree is formatted and lint-clean
# (`.venv/bin/ruff format .` fixes the first), and the package type-checks.
# .pre-commit-config.yaml runs the same commands (its mypy hook is `make mypy`).
# The whole package (issue 43 item 4), at pyproject.toml's [tool.mypy] strictness.
MYPY_PATHS := megatron_ext
lint:
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .
	$(MAKE) --no-print-directory mypy

mypy:
	.venv/bin/mypy $(MYPY_PATHS)

# --durations: the log shows where the time goes (make test must stay under 30 minutes, both megatron-cores).
test-single: test-unit test-functional

test-unit:
	$(PY) -m pytest tests --ignore=tests/functional_tests --durations=15

test-functional:
	$(PY) -m pytest tests/functional_tests --durations=15

# A multi-rank session collects only the files holding tests for its world (tests/conftest.py):
# every rank importing the whole suite to deselect most of it cost each session seconds of CPU.
rank_test_files = $(shell grep -rlE 'world_size\($(1)\)' tests/unit_tests | sort)

test-2ranks:
	$(TORCHRUN) --nproc_per_node 2 -m pytest $(call rank_test_files,2) --durations=10

test-4ranks:
	$(TORCHRUN) --nproc_per_node 4 -m pytest $(call rank_test_files,4) --durations=10

# The soak tier of the two-node Slurm tests (root; a two-node cluster on this machine,
# scripts/slurm_cluster.sh): a lost node with and without requeue, the stop signal to a
# two-node job, the multi-module recipe split over the nodes. make test runs the golden one.
test-multinode: setup
	MEGATRON_EXT_SOAK=1 $(PY) -m pytest tests/functional_tests/test_slurm_multinode.py --durations=0

# The whole soak tier (root, about an hour on 2 cores): every functional test with
# MEGATRON_EXT_SOAK=1, i.e. besides make test's runs the shipped recipes make test leaves to
# this tier (tests/functional_tests/test_recipes.py: SOAK_RECIPES), the ZB-H1 twin of the
# TP2xPP2+SP recipe, the racing and fault variants, the two-node faults and the checkpoint moves.
# On megatron-core 0.20 it also trains every shipped recipe, and moves an upstream mHC checkpoint
# (tests/unit_tests/mcore_020), on both 0.20 builds: #4946 (mHC with PP) and main (PP 1 only).
MEGATRON_CORE_WHEEL_PP ?= ../shared/wheels/megatron-core-0.20-mhc-pp
MEGATRON_CORE_WHEEL_MAIN ?= ../shared/wheels/megatron-core-0.20-main
test-soak: setup
	MEGATRON_EXT_SOAK=1 $(PY) -m pytest tests/functional_tests --durations=0
	MEGATRON_EXT_SOAK=1 $(TORCHRUN) --nproc_per_node 4 -m pytest tests/unit_tests/checkpoint/test_resharding_4ranks.py --durations=0
	MEGATRON_CORE_WHEEL=$(MEGATRON_CORE_WHEEL_PP) $(MCORE020) soak
	MEGATRON_CORE_WHEEL=$(MEGATRON_CORE_WHEEL_MAIN) $(MCORE020) soak

# Every case of a Megatron-LM checkout through import, validate and run --dry-run (issue 33):
# make test-upstream-cases MEGATRON_LM_CASES=/path/to/Megatron-LM/tests/functional_tests/test_cases
test-upstream-cases:
	@test -n "$(MEGATRON_LM_CASES)" || { echo "give MEGATRON_LM_CASES=/path/to/Megatron-LM/tests/functional_tests/test_cases"; exit 2; }
	MEGATRON_LM_CASES=$(MEGATRON_LM_CASES) $(PY) -m pytest tests/unit_tests/upstream_cases/test_upstream_case_tree.py -k upstream_case

# Build the wheel and install it, as a user would, beside the megatron-core already installed
# (a venv layered on .venv, pip --no-index): megatron-core must stay, `megatron-ext doctor` pass.
test-install:
	scripts/check_wheel_install.sh $(PY)

# The CPU side of the GPU check: the wheelhouse builds and fits in 64 MiB, the gpu tests collect.
test-gpu-prep:
	scripts/build_wheelhouse.sh build/wheelhouse $(PY)
	@n=$$($(PY) -m pytest -o addopts="" -p no:cacheprovider tests/gpu -m gpu --collect-only -q | grep -c "::test_"); \
	  echo "$$n gpu tests collected"; [ $$n -ge 5 ]
	bash -n scripts/gpu_check.sh

# A wheelhouse to carry to a GPU machine without network (scripts/gpu_check.sh installs from it).
wheelhouse:
	scripts/build_wheelhouse.sh wheelhouse $(PY)

# The gpu-marked tests on this machine's GPU (in the Docker image: docker run --gpus all IMAGE make test-gpu).
GPU_PY := $(if $(wildcard .venv/bin/python),.venv/bin/python,python)
test-gpu:
	@$(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu needs a GPU (docker run --gpus all ...)')"
	$(GPU_PY) -m pytest tests/gpu -m gpu -v -rs

doctor: setup
	.venv/bin/megatron-ext doctor

clean:
	rm -rf .venv .venv-mcore-0.20 build wheelhouse *.egg-info
