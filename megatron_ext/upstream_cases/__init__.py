"""Megatron-LM's functional test cases as megatron-ext recipes.

:mod:`.model_config` reads a case's ``model_config.yaml`` (and names its golden values files)
and turns it into recipe sections plus the cpu overlay that shrinks the model to a few CPU
cores. The recipe loader hands it any file that looks like a test case; ``megatron-ext import``
writes the result as a recipe YAML. It builds on the recipe schema and flag tables
(``recipes.schema``, ``recipes.flags``) and on nothing that runs.
"""
