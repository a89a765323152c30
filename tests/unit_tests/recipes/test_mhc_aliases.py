"""Recipes accept upstream dev's mHC spellings in extra_args (flags and config field names)."""

import pytest

from megatron_ext.recipes import RecipeError, load
from megatron_ext.recipes.command import megatron_args

from recipe_texts import MINIMAL


@pytest.mark.parametrize(
    "enable, streams",
    [
        ("enable_hyper_connections", "num_residual_streams"),  # dev's TransformerConfig fields
        ("--enable-hyper-connections", "--num-residual-streams"),  # dev's flags
    ],
)
def test_dev_spellings_become_model_mhc(write_recipe, enable, streams):
    path = write_recipe(MINIMAL + f"extra_args: {{{enable}: true, {streams}: 2}}\n")
    loaded = load(path)
    assert loaded.recipe.model.mhc.enabled and loaded.recipe.model.mhc.num_residual_streams == 2
    assert loaded.recipe.extra_args == {}
    args = megatron_args(loaded)
    assert "--enable-mhc-connections" in args
    assert args[args.index("--mhc-num-residual-streams") + 1] == "2"
    assert not any("hyper" in a or a == "--num-residual-streams" for a in args), (
        "one spelling on the line"
    )


def test_an_alias_contradicting_model_mhc_is_reported(write_recipe):
    text = MINIMAL.replace(
        "seq_length: 32}", "seq_length: 32, mhc: {enabled: true, num_residual_streams: 4}}"
    )
    path = write_recipe(text + "extra_args: {num_residual_streams: 2}\n")
    with pytest.raises(
        RecipeError,
        match=r"extra_args.num_residual_streams.*contradicts model.mhc.num_residual_streams",
    ):
        load(path)
