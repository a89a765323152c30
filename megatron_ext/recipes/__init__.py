"""Functional recipes: YAML files that say what to train, on how many ranks, for how long,
and which golden values the loss curve must match.

- :mod:`~megatron_ext.recipes.schema`: the versioned schema (dataclasses with defaults and docs);
- :mod:`~megatron_ext.recipes.loader`: YAML, platform overlays, ``KEY=VALUE`` overrides;
- :mod:`~megatron_ext.recipes.plan`: the Megatron command line and the plan checks;
- :mod:`~megatron_ext.recipes.validate`: plan checks, then Megatron's own checks and the guards;
- :mod:`~megatron_ext.runs.runner`: ``megatron-ext run`` (local ranks, run directory);
- :mod:`~megatron_ext.runs.metrics`, :mod:`~megatron_ext.runs.golden`,
  :mod:`~megatron_ext.runs.plot`: log lines to golden-value JSON, Megatron's comparison
  rules, the loss-curve PNG;
- :mod:`~megatron_ext.recipes.schedule`, :mod:`~megatron_ext.runs.trace`: the pipeline
  schedule a recipe trains with, and a traced run's summary (through
  :mod:`megatron_ext.schedules`).

The schema is documented in recipes/README.md. Importing this package imports neither torch
nor megatron.
"""

from megatron_ext.recipes.loader import LoadedRecipe, load
from megatron_ext.recipes.schema import SCHEMA_VERSION, Problem, Recipe, RecipeError

__all__ = ["LoadedRecipe", "Problem", "Recipe", "RecipeError", "SCHEMA_VERSION", "load"]
