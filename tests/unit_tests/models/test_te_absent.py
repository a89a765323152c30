"""megatron_ext.models.te_absent: megatron-core 0.20.0's MTP layer asks
``is_inference_column_parallel_linear``, whose isinstance gets Transformer Engine's stand-ins
on a machine without TE. The fix is a patch scoped to 0.20.0 (0.19.2 has no such check)."""

import pytest

from megatron_ext import registry
from megatron_ext.testing.distributed import model_parallel

TARGET = "megatron.core.transformer.multi_token_prediction:is_inference_column_parallel_linear"


def _transformer_engine_absent() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return not HAVE_TE


def test_the_fix_applies_exactly_where_the_bug_is():
    scoped = next(p for p in registry.patches(every=True) if p.target == TARGET)
    assert scoped.applies_on == ("0.20.0",) and scoped.verified == ("0.20.0",)
    applies = registry.megatron_core_version() == "0.20.0"
    assert registry.applies(scoped) == applies
    assert (scoped in registry.patches("core")) == applies


def test_without_te_the_check_answers_false_instead_of_raising():
    if registry.megatron_core_version() != "0.20.0" or not _transformer_engine_absent():
        return  # 0.19.2 (or TE present): no such bug; the scope is the test above
    with model_parallel():  # install(): the core patches
        from megatron.core.transformer import multi_token_prediction as mtp

        assert mtp.is_inference_column_parallel_linear(object()) is False
        with registry.suspended(TARGET), pytest.raises(TypeError, match="isinstance"):
            mtp.is_inference_column_parallel_linear(object())
