"""Tests that need megatron-core 0.20's own mHC classes (upstream's HyperConnectionModule and
HyperConnectionTransformerLayer): collected only where the installed megatron-core has them
(the 0.20 lane, `make test-mcore-0.20`), not collected (not skipped) on 0.19.2."""

import importlib.util


def _upstream_has_mhc() -> bool:
    try:
        return importlib.util.find_spec("megatron.core.transformer.hyper_connection") is not None
    except ImportError:
        return False


collect_ignore_glob = [] if _upstream_has_mhc() else ["test_*.py"]


def pytest_collection_modifyitems(config, items):
    """A file named on the command line (the multi-rank sessions name theirs) is collected
    despite collect_ignore_glob: deselect its tests too where upstream has no mHC."""
    if _upstream_has_mhc():
        return
    here = __file__.rsplit("/", 1)[0] + "/"
    ours = [item for item in items if str(item.path).startswith(here)]
    if ours:
        config.hook.pytest_deselected(items=ours)
        items[:] = [item for item in items if item not in ours]
