"""mHC's configuration fields as data: their defaults and every spelling of the two aliased flags.

One declaration for what several readers need: :class:`megatron_ext.config.MHCTransformerConfig`
takes its field defaults from :data:`MHC_DEFAULTS`, and so does the recipe schema's ``model.mhc``
section (a test checks the two agree); the command line (``training_steps``), a recipe's
``extra_args`` (``recipes.loader``), an imported Megatron-LM test case
(``upstream_cases.model_config``) and the detection of a Megatron-LM that declares mHC itself
(``checkout``) all read :data:`MHC_ALIASES`. Upstream main spells the two fields ``enable_mhc_connections`` /
``mhc_num_residual_streams``; upstream dev (and DeepSeek-V4 configs) ``enable_hyper_connections``
/ ``num_residual_streams``; each has a flag of the same name.

Nothing here imports torch or megatron, so recipes are read and checked without them.
"""

from __future__ import annotations

from dataclasses import dataclass

MHC_DEFAULTS: dict[str, object] = {
    "enable_mhc_connections": False,
    "mhc_num_residual_streams": 4,
    "mhc_sinkhorn_iterations": 20,
    "mhc_h_res_method": "sinkhorn",  # ours (mHC-lite's "birkhoff" is the other); not upstream's
    "mhc_init_gating_factor": 0.01,
    "mhc_recompute_layer_num": None,
    "mhc_learned_output_contract": False,
    "mhc_single_pass": False,
    "use_fused_mhc": False,
    "mhc_variant": "megatron",  # ours: "deepseek-v4" / "glm5" maps (megatron_ext.mhc.variants)
}
"""Upstream's defaults of the mHC fields of :class:`~megatron_ext.config.MHCTransformerConfig`."""


def flag_of(field_name: str) -> str:
    """The command-line flag of a TransformerConfig field (megatron's ArgumentGroupFactory)."""
    return "--" + field_name.replace("_", "-")


@dataclass(frozen=True)
class MHCAlias:
    """One mHC field under upstream main's name (ours) and upstream dev's."""

    recipe_field: str  # the field of a recipe's model.mhc section
    main_field: str  # upstream main's TransformerConfig field (MHCTransformerConfig's)
    dev_field: str  # upstream dev's TransformerConfig field

    @property
    def main_flag(self) -> str:
        return flag_of(self.main_field)

    @property
    def dev_flag(self) -> str:
        return flag_of(self.dev_field)

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every key that sets this field: both flags, then both field names."""
        return (self.main_flag, self.dev_flag, self.main_field, self.dev_field)


MHC_ALIASES = (
    MHCAlias("enabled", "enable_mhc_connections", "enable_hyper_connections"),
    MHCAlias("num_residual_streams", "mhc_num_residual_streams", "num_residual_streams"),
)
"""The two mHC fields that upstream main and dev spell differently (the only aliases)."""

ENABLE_ALIAS = MHC_ALIASES[0]


__all__ = ["ENABLE_ALIAS", "MHC_ALIASES", "MHC_DEFAULTS", "MHCAlias", "flag_of"]
