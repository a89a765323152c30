# The two commands of the README: `make run` and `make test` (both set up .venv when needed).
PY        := .venv/bin/python
TORCHRUN  := .venv/bin/torchrun --standalone --local-ranks-filter 0
# Two cores: one thread per rank keeps 2-4 gloo ranks from fighting over them.
export OMP_NUM_THREADS ?= 1

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
test: setup
	$(MAKE) --no-print-directory -j2 --output-sync=target test-functional test-lanes

test-lanes:
	@$(MAKE) --no-print-directory lint
	@$(MAKE) --no-print-directory test-unit
	@$(MAKE) --no-print-directory test-2ranks
	@$(MAKE) --no-print-directory test-4ranks
	@$(MAKE) --no-print-directory test-install
	@$(MAKE) --no-print-directory test-gpu-prep

# ruff and mypy (configured in pyproject.toml): the tree is formatted and lint-clean
# (`.venv/bin/ruff format .` fixes the first), and the typed core type-checks.
# .pre-commit-config.yaml runs the same commands (its mypy hook is `make mypy`).
MYPY_PATHS := megatron_ext/mhc megatron_ext/pipeline megatron_ext/schedules megatron_ext/parallel_plan.py \
	megatron_ext/registry.py megatron_ext/declarations.py megatron_ext/config megatron_ext/errors.py \
	megatron_ext/mhc_flags.py megatron_ext/launch/shell.py megatron_ext/recipes megatron_ext/runs megatron_ext/upstream_cases \
	megatron_ext/checkpoint megatron_ext/cli/_quiet.py
lint:
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .
	$(MAKE) --no-print-directory mypy

mypy:
	.venv/bin/mypy $(MYPY_PATHS)

# --durations: the log shows where the time goes (make test must stay under 20 minutes).
test-single: test-unit test-functional

test-unit:
	$(PY) -m pytest tests --ignore=tests/functional_tests --durations=15

test-functional:
	$(PY) -m pytest tests/functional_tests --durations=15

test-2ranks:
	$(TORCHRUN) --nproc_per_node 2 -m pytest tests/unit_tests --durations=10

test-4ranks:
	$(TORCHRUN) --nproc_per_node 4 -m pytest tests/unit_tests --durations=10

# The soak tier of the two-node Slurm tests (root; a two-node cluster on this machine,
# scripts/slurm_cluster.sh): a lost node with and without requeue, the stop signal to a
# two-node job, the multi-module recipe split over the nodes. make test runs the golden one.
test-multinode: setup
	MEGATRON_EXT_SOAK=1 $(PY) -m pytest tests/functional_tests/test_slurm_multinode.py --durations=0

# The whole soak tier (root, about an hour on 2 cores): every functional test with
# MEGATRON_EXT_SOAK=1, i.e. besides make test's runs the shipped recipes make test leaves to
# this tier (tests/functional_tests/test_recipes.py: SOAK_RECIPES), the ZB-H1 twin of the
# TP2xPP2+SP recipe, the racing and fault variants, the two-node faults and the checkpoint moves.
test-soak: setup
	MEGATRON_EXT_SOAK=1 $(PY) -m pytest tests/functional_tests --durations=0

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
	rm -rf .venv build wheelhouse *.egg-info
