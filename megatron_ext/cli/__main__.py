"""``python -m megatron_ext.cli``: the ``megatron-ext`` command."""

import sys

from megatron_ext.cli import main

sys.exit(main())
