"""What a run does, once a recipe has been checked: launch its phases and judge the result.

A run starts from one :class:`~megatron_ext.recipes.request.RunRequest` (the recipe's answers,
built once by :func:`megatron_ext.recipes.prepare.prepare`) and one
:class:`~megatron_ext.runs.options.RunOptions` (the command line's switches); of
:mod:`megatron_ext.recipes` it imports only the request and the schema.

- :mod:`~megatron_ext.runs.runner`: ``megatron-ext run`` (local ranks, the run directory, the
  verdict and ``summary.json``); :mod:`~megatron_ext.runs.submit`: the same run as a Slurm job;
- :mod:`~megatron_ext.runs.lock`: one run per run directory;
- :mod:`~megatron_ext.runs.listing`, :mod:`~megatron_ext.runs.resume`: run directories as a list,
  and one across its stops and resumes;
- :mod:`~megatron_ext.runs.metrics`, :mod:`~megatron_ext.runs.golden`,
  :mod:`~megatron_ext.runs.plot`, :mod:`~megatron_ext.runs.mhc_report`: log lines to golden-value
  JSON, Megatron's comparison rules, the curves as PNG, the mHC statistics;
- :mod:`~megatron_ext.runs.trace`, :mod:`~megatron_ext.runs.side_by_side`: a traced run's
  summary, and two runs side by side.

What a recipe *is* (schema, loading, checks, the command it becomes) lives in
:mod:`megatron_ext.recipes`. Importing this package imports neither torch nor megatron.
"""
