"""``python -m nnx_shard.cli``: the ``nnx-shard`` command."""

import contextlib
import sys

from nnx_shard.cli import main

with contextlib.suppress(BrokenPipeError):
    sys.exit(main())
