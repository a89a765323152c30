"""Functional recipes: YAML files that say what to train, on how many ranks, for how long,
and which golden values the loss curve must match.

- :mod:`~megatron_ext.recipes.schema`: the versioned schema (dataclasses with defaults and docs)
  and the facts derived from it (virtual stages, MTP depths, the parallel plan, resumability);
- :mod:`~megatron_ext.recipes.loader`: YAML, platform overlays, ``KEY=VALUE`` overrides;
- :mod:`~megatron_ext.recipes.checks`: the plan checks that need no process;
- :mod:`~megatron_ext.recipes.command`: the Megatron command line a recipe becomes;
- :mod:`~megatron_ext.recipes.validate`: plan checks, then Megatron's own checks and the guards;
- :mod:`~megatron_ext.recipes.schedule`: the pipeline schedule a recipe trains with (through
  :mod:`megatron_ext.schedules`);
- :mod:`~megatron_ext.recipes.prepare`: where recipes/ ends: a checked recipe becomes one frozen
  :class:`~megatron_ext.recipes.request.RunRequest`, everything a run reads of it.

What a run does with that request (launching, metrics, the golden verdict) is
:mod:`megatron_ext.runs`; a Megatron-LM test case is read into a recipe by
:mod:`megatron_ext.upstream_cases`. The schema is documented in recipes/README.md. Importing this
package imports neither torch nor megatron.
"""

from megatron_ext.recipes.loader import LoadedRecipe, load
from megatron_ext.recipes.schema import SCHEMA_VERSION, Problem, Recipe, RecipeError

__all__ = ["LoadedRecipe", "Problem", "Recipe", "RecipeError", "SCHEMA_VERSION", "load"]
