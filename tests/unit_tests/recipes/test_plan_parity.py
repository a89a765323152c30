"""recipes/schema.py reads pipeline layouts and hybrid patterns without importing megatron (so
``megatron-ext validate`` stays light); these tests hold its readings to megatron-core's own
parsers, so an upgrade that changes megatron's grammar fails here instead of in a run."""

import pytest

from megatron.core.models.hybrid import hybrid_layer_allocation as hybrid
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from megatron_ext.recipes import schema

LAYOUTS = ["E|tt|tt|L", "E|(tt|)*6,L", "Ettt|(tt|)*3,m|L", "Et*3|t|tL", "(|t)*2,t|L", "E|t|m|L"]
PATTERNS = [
    "*-*-|*-*-/*-",
    "*-|*-|*-|/*-",
    "M*M-M*M-|M*M-M*M-|M*M-M*M-|/*-",
    "*-E",
    "*-/*-/*-",
    "MGD+-E|-",
    "*M-E|G-",
    "*|*",
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_stages_match_megatron(layout):
    stages = schema.layout_stages(layout)
    megatron = PipelineParallelLayerLayout.parse_str_to_list(layout)
    assert (
        len(stages) == len(megatron) == PipelineParallelLayerLayout.get_num_stages_from_str(layout)
    )
    symbol = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
    assert [[symbol[ch] for ch in stage] for stage in stages] == [
        [layer.name for layer in stage] for stage in megatron
    ]


def test_layout_symbols_are_megatrons():
    for symbol in schema.LAYOUT_SYMBOLS:
        PipelineParallelLayerLayout.parse_str_to_list(symbol)
    with pytest.raises(AssertionError):
        PipelineParallelLayerLayout.parse_str_to_list("x")
    with pytest.raises(ValueError, match="unknown symbol"):
        schema.layout_stages("x")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_hybrid_pattern_readings_match_megatron(pattern):
    segments, mtp = schema.hybrid_segments(pattern)
    parsed = hybrid.parse_hybrid_pattern(pattern)
    assert "|".join(segments) == parsed.main_pattern
    assert len(segments) == hybrid.get_hybrid_total_pipeline_segment_count(pattern)
    assert schema.hybrid_layer_count(pattern) == hybrid.get_hybrid_total_layer_count(pattern)
    assert len(mtp) == parsed.mtp_num_depths
    assert (mtp[0] if mtp else None) == parsed.mtp_pattern


def test_hybrid_symbols_are_megatrons():
    assert set(schema.HYBRID_SYMBOLS) == hybrid.Symbols.VALID_LAYERS
