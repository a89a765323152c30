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
