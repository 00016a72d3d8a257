"""Where XLA CPU's compiled figures stand for an accelerator's, and where they do not.

``nnx-shard plan`` and the planner's search compile the train step for simulated CPU
devices: the figures are XLA CPU's buffer assignment, which can differ from a GPU's or
a TPU's. Compared with published training runs (``benchmarks/published.py``; the figures are
in docs/benchmarks.md, "Planned against published runs"), the CPU compile of
:meth:`nnx_shard.Trainer.fit`'s call is close to the published per-device memory on
layouts without a pipeline, and there the compiled figure is trusted. Under a pipeline
it is far above: the pipeline's loop on XLA CPU keeps every microbatch's carries and
stage buffers alive across its iterations, where a 1F1B run frees them, while the
per-stage formula (:class:`nnx_shard._stage_report.StageReport` plus the gradients)
stays close.

So under a pipeline the compiled figure is an upper bound and the per-stage formula
decides. JAX compiles for an absent accelerator only for TPUs, and only where libtpu is
installed (``jax.experimental.topologies``); there is no deviceless CUDA compile.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PIPELINE_NOTICE", "compiled_trusted"]

#: What ``plan`` says where the CPU compile of a pipeline is not trusted.
PIPELINE_NOTICE = (
    "XLA CPU's figure for a pipeline is not an accelerator's: its pipeline loop keeps "
    "every microbatch's buffers alive across iterations (against published runs: "
    "docs/benchmarks.md, 'Planned against published runs'). The compiled total is an "
    "upper bound; the per-stage formula decides.")


def compiled_trusted(strategy: Any, backend: str = "cpu") -> tuple[bool, str | None]:
    """Whether XLA's compiled memory figure of ``strategy``'s train step on ``backend``
    stands for an accelerator's; where it does not, the notice that says why.

    >>> from nnx_shard import strategies
    >>> compiled_trusted(strategies.get("fsdp_tp"))
    (True, None)
    >>> ok, why = compiled_trusted(strategies.get("pp_fsdp"))
    >>> ok, why.split(":")[0]
    (False, "XLA CPU's figure for a pipeline is not an accelerator's")
    >>> compiled_trusted(strategies.get("pp_fsdp"), backend="tpu")
    (True, None)
    """
    if backend != "cpu":
        return True, None
    if strategy.rules.options.get("pipeline") is not None:
        return False, PIPELINE_NOTICE
    return True, None
