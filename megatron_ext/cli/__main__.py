"""``python -m megatron_ext.cli``: the ``megatron-ext`` command."""

from megatron_ext.cli import console_main

console_main()
