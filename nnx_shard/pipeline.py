"""Pipeline parallelism: a stack of layers split over a ``stage`` mesh axis.

A model whose repeated blocks are stacked under a leading layer axis (the
reference :class:`~nnx_shard.models.Decoder` with ``scan_layers=True``, or
any ``nnx.vmap``-stacked module created with
``transform_metadata={nnx.PARTITION_NAME: "layers"}``) runs its layer loop
through :func:`scan`. With no pipeline option active, :func:`scan` is
``jax.lax.scan``. Under a pipeline strategy (:func:`~nnx_shard.strategies._presets.pp`,
whose rules carry the execution option ``pipeline=Schedule(...)``) the same
call runs the stack as a pipeline:

* the ``[L, ...]`` stack is stored sharded over ``stage`` (rule ``layers ->
  stage``): each device holds ``L/S`` consecutive layers and their optimizer
  state, so a checkpoint means the same model under any strategy;
* the batch is cut into ``M`` microbatches (the ``microbatches=M`` of
  :class:`nnx_shard.Trainer` / :func:`nnx_shard.multistep`: under a pipeline
  strategy they are consumed inside one forward pass instead of
  :func:`nnx_shard.value_and_grad`'s accumulation loop); microbatch ``j`` holds
  rows ``j, j+M, ...`` as gradient accumulation does. Only the stack sees
  microbatches: the layers after it and the loss run once on the whole batch,
  so a mean over kept targets (:func:`nnx_shard.models.lm_loss`) is the step's
  mean, as with one microbatch, whatever each microbatch keeps;
* a state buffer ``[S, microbatch, ...]`` sharded over ``stage`` holds what
  each stage works on. For ``M*V + S - 1`` iterations every stage applies its
  layers (``jax.vmap`` over the stage dimension with ``spmd_axis_name``, so
  every activation constraint in the model keeps ``stage`` on that
  dimension), then the buffer moves one stage on (``jnp.roll``: a
  collective-permute over ``stage``), the next microbatch enters stage 0 and
  the last stage's output, which the roll brings to stage 0, is kept there;
* ``jax.grad`` of that loop is GPipe: all forward, then all backward.

Schedules (``Schedule.repeats = V``):

* ``V = 1``, GPipe: stage ``s`` holds layers ``s*L/S ... (s+1)*L/S - 1``.
  Idle fraction of stage-steps (the bubble): ``(S-1)/(M+S-1)``.
* ``V > 1``, circular (MaxText's ``num_pipeline_repeats``): the stack is cut
  into ``S*V`` groups of ``L/(S*V)`` layers and stage ``s`` runs groups ``s,
  s+S, s+2S, ...``; each microbatch goes round the stages ``V`` times. Bubble:
  ``(S-1)/(M*V+S-1)``. Needs ``M >= S``.

  Storage: the stack stays stored contiguously (the layout of ``V = 1``, and
  of checkpoints), and each step re-lays it out to the circular order inside
  the compiled program (and the gradients back): a fixed per-step
  communication of ``(V-1)/V`` of the stack's parameters (and as much again
  for their gradients) over ``stage``, in exchange for checkpoints that mean
  the same model under every strategy. ``benchmarks/pipeline.py`` measures it.

Embeddings, the head and everything outside the stack are placed by the rest
of the rules table (replicated over ``stage``). Activations enter and leave the
pipeline once per step: an all-reduce over ``stage`` of the pipeline's output
(stage 0 holds it) and, in the backward pass, of the input's gradient. Meshes
with Explicit axes are not supported (a ``ShardingError`` says to use Auto axes,
the default of :func:`nnx_shard.make_mesh`).

>>> import jax.numpy as jnp
>>> from nnx_shard.pipeline import scan
>>> layers = {"w": jnp.full((4, 3), 0.5)}
>>> body = lambda h, layer: (h * layer["w"], None)
>>> out, _ = scan(body, jnp.ones((2, 3)), layers)   # no pipeline active: jax.lax.scan
>>> out[0].tolist()
[0.0625, 0.0625, 0.0625]
"""

from nnx_shard._parallel.pipeline import run, scan
from nnx_shard._parallel.schedule import (
    Schedule,
    bubble,
    idle_fraction,
    schedule_table,
    stage_count,
)
from nnx_shard._parallel.stack import stack, unstack
from nnx_shard._stage_report import StageReport, stage_report

__all__ = ["Schedule", "StageReport", "bubble", "idle_fraction", "run", "scan", "schedule_table",
           "stack", "stage_count", "stage_report", "unstack"]
