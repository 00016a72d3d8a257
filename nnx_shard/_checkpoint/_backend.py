"""orbax, imported on first use and called only through its public options.

Nothing of orbax, absl's logger, asyncio or the interpreter's exit is changed here
or anywhere in nnx_shard (``tests/test_no_global_patches.py``). What orbax does
on its own stays its own, and the user's to configure:

* its log records (through absl's logger, ``logging.getLogger("absl")``): a failed
  background save makes orbax log the error of each of its threads with a
  traceback before nnx_shard raises it once; a program that wants only
  nnx_shard's one error silences them with its own logging configuration, e.g.
  ``logging.getLogger("absl").setLevel(logging.CRITICAL)``;
* its raw-bytes telemetry (``tensorstore.experimental_collect_matching_metrics``,
  twice per array written or read), whose results tensorstore 0.1.86 keeps:
  resident memory grows by a few KB per save (``benchmarks/checkpoint_rss.py``);
  orbax 0.12.8 has no option to turn it off;
* the reports of the reads orbax abandons when one read of a damaged checkpoint
  failed (tensorstore's "Event loop is closed" and "Exception ignored in:
  <coroutine ...>" through ``sys.unraisablehook``, asyncio's "Task exception was
  never retrieved" through its logger): the failure itself is one ``ValueError``.
"""

from __future__ import annotations

from typing import Any


def orbax_module() -> Any:
    """``orbax.checkpoint``, imported on first use (it pulls in tensorstore and more).

    >>> orbax_module().__name__
    'orbax.checkpoint'
    """
    import orbax.checkpoint as ocp

    return ocp
