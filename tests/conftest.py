"""Test-session set-up shared by unit and functional tests.

Distributed tests run as one pytest session per rank under torchrun, e.g.
``torchrun --nproc_per_node 4 -m pytest tests/unit_tests``. A test declares the world it
needs with ``@pytest.mark.world_size(N)``; a session collects exactly the tests written for
its world (``WORLD_SIZE`` from torchrun, 1 without it) and deselects the rest, so every
test runs once, in the world it was written for, and none is reported as skipped.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import warnings

import pytest

from megatron_ext.launch import startup


def _interpret_triton_without_cuda() -> None:
    """Without CUDA, Triton kernels can only run under Triton's interpreter, and it must be on
    before ``triton.language`` is imported (megatron-core imports it): so switch it on here,
    before any test module is imported. Nothing else changes on such a machine (no Triton
    kernel could run otherwise; torch's CPU inductor does not use Triton; imports measured no
    slower). An explicit TRITON_INTERPRET is left alone."""
    import torch  # does not import triton

    if not torch.cuda.is_available() and "triton.language" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_cuda()


def _session_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "world_size(n): run this test only in an n-rank torchrun session"
    )
    config.addinivalue_line(
        "markers",
        "every_case: every parametrized case runs, also under --one-case-per-test",
    )
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (tests/gpu; skipped without one, run by make test-gpu)"
    )
    # megatron-core is chatty about optional dependencies that a CPU machine never has.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|absl|MimoModelConfig).*")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    # Collection imports megatron: without torch's compiler or the cyclic GC, as the entry points do.
    startup.begin_entry_imports()


def pytest_collection_finish(session: pytest.Session) -> None:
    startup.end_entry_imports()
    # What collection imported lives as long as the session: frozen, the collections that
    # release each multi-rank test's process groups walk only what the tests made.
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _release_process_groups():
    """Every test leaves no process group of its own behind (see releasing_new_process_groups)."""
    from megatron_ext.testing.distributed import releasing_new_process_groups

    with releasing_new_process_groups():
        yield


@pytest.fixture(autouse=True)
def _fresh_moe_aux_loss_scale():
    """megatron-core keeps the MoE aux-loss scale on a class, shaped by its first setter: a MoE
    backward outside megatron's schedules (a plain ``loss.backward()`` in a test) leaves a 0-d
    tensor that the schedules' 1-element scale then cannot be copied into. Every test starts
    without one, whatever ran before it in the session."""
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    yield


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--one-case-per-test",
        action="store_true",
        help="run only the first parametrized case of each test function (make test's "
        "megatron-core 0.20 multi-rank sessions: scripts/mcore_020_lane.sh)",
    )


def _first_cases(items: list[pytest.Item]) -> set[str]:
    """Node ids of each test function's first collected case (every case of a function
    marked every_case)."""
    first: dict[str, str] = {}
    chosen = set()
    for item in items:
        if item.get_closest_marker("every_case"):
            chosen.add(item.nodeid)
        else:
            first.setdefault(item.nodeid.split("[", 1)[0], item.nodeid)
    return chosen | set(first.values())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    world = _session_world_size()
    wanted_ids = _first_cases(items) if config.getoption("one_case_per_test") else None
    selected, deselected = [], []
    for item in items:
        marker = item.get_closest_marker("world_size")
        wanted = marker.args[0] if marker else 1
        chosen = wanted == world and (wanted_ids is None or item.nodeid in wanted_ids)
        (selected if chosen else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


@pytest.fixture(scope="session")
def example_data():
    """The example corpus, tokenizers and datasets (`prepare-data --example`) at the path the
    real-data recipes read by default (REPO_ROOT/example_data); built once and reused while
    its inputs (Python, tokenizer libraries, megatron_ext/data code) are unchanged."""
    from pathlib import Path

    from megatron_ext.data.example import ensure_example

    return ensure_example(str(Path(__file__).resolve().parents[1] / "example_data"))
