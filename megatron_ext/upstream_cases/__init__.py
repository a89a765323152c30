"""Megatron-LM's functional test cases as megatron-ext recipes.

:mod:`.model_config` reads a case's ``model_config.yaml`` (and names its golden values files)
and turns it into recipe sections plus the cpu overlay that shrinks the model to a few CPU
cores. The recipe loader hands it any file that looks like a test case; ``megatron-ext import``
writes the result as a recipe YAML. It sits below ``recipes/`` and imports nothing of it: the
flag tables it shares with the recipes are :mod:`megatron_ext.recipe_flags`, and the schema's
defaults are handed in by the caller. Nothing here runs anything.
"""
