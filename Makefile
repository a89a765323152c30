# The two commands of the README: `make run` and `make test` (both set up .venv when needed).
PY        := .venv/bin/python
TORCHRUN  := .venv/bin/torchrun --standalone --local-ranks-filter 0
# Two cores: one thread per rank keeps 2-4 gloo ranks from fighting over them.
export OMP_NUM_THREADS ?= 1

.PHONY: setup run demo test test-single test-2ranks test-4ranks test-install doctor clean

setup:
	@scripts/bootstrap.sh

# The mHC hybrid recipe (TP2 x PP2, MTP) on 4 CPU ranks through megatron.training.pretrain:
# one line per iteration, then runs/<name>-cpu-<time>/ with metrics, loss.png and the golden check.
run: setup
	.venv/bin/megatron-ext run recipes/hybrid_mhc_tp2_pp2_mtp.yaml

# The first demo: a tiny GPT, PP=2 on 2 CPU ranks.
demo: setup
	$(PY) -m megatron_ext.launch.demo

# Unit tests first in one process, then as one pytest session per rank under torchrun:
# each session runs the tests marked for its world size (tests/conftest.py).
test: setup test-single test-2ranks test-4ranks test-install

test-single:
	$(PY) -m pytest tests

test-2ranks:
	$(TORCHRUN) --nproc_per_node 2 -m pytest tests/unit_tests

test-4ranks:
	$(TORCHRUN) --nproc_per_node 4 -m pytest tests/unit_tests

# Build the wheel and install it, as a user would, beside the megatron-core already installed
# (a venv layered on .venv, pip --no-index): megatron-core must stay, `megatron-ext doctor` pass.
test-install:
	scripts/check_wheel_install.sh $(PY)

doctor: setup
	.venv/bin/megatron-ext doctor

clean:
	rm -rf .venv build *.egg-info
