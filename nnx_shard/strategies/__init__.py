"""Parallelism strategies as rules presets: a change of table, never of model code.

Each preset returns a :class:`Strategy`: the :class:`~nnx_shard.Rules` for
parameters and activations, a separate table for optimizer state where the
strategy needs one (ZeRO-1 and ZeRO-2), the mesh axes it expects and a default mesh shape.
Models annotated with the logical names ``batch``, ``length``, ``embed``,
``heads``, ``kv_heads``, ``kv``, ``mlp``, ``vocab``, ``layers`` and ``expert`` (as
:class:`nnx_shard.models.Decoder` and :class:`nnx_shard.models.Decoder` are) run
under any of them. ``kv_heads`` (grouped-query attention's key/value heads) follows
``heads`` onto the model axis where it divides it, else it is replicated. The key/value
cache of :func:`nnx_shard.inference.generate` is named ``cache_batch`` (as ``batch``),
``cache_kv_heads`` (as ``kv_heads``), ``cache_length`` (over ``context`` under cp and
fsdp_cp, else replicated) and ``cache_head_dim`` (replicated).

=========  ===============  ================================================  ==========================================
name       mesh axes        sharded                                           collectives per train step (XLA CPU)
=========  ===============  ================================================  ==========================================
dp         data             batch                                             all-reduce over data (gradients)
zero1      data             batch; optimizer state over ``embed``;            all-reduce over data (gradients),
                            gradients whole (option ``gradients``)            all-gather over data (updated parameters)
zero2      data             zero1, with each gradient reduced to its          all-reduce over data (gradients, each
                            optimizer state's 1/N slice (option               then sliced: a reduce-scatter [1]_;
                            ``gradients``), microbatch sums kept 1/N          inside the microbatch loop), all-gather
                                                                              over data (updated parameters)
fsdp       data             batch; params, grads, opt. state over ``embed``   all-gather over data (parameters),
                                                                              all-reduce over data (gradients) [1]_
hsdp       replica, data    fsdp over data within each replica; batch over    all-gather over data (parameters),
                            replica x data; params replicated across          all-reduce over data (gradients) [1]_,
                            replica (``Strategy.across``: replica spans       then over replica on each device's 1/data
                            processes in a ``jax.distributed`` job)           slice [3]_
tp         data, model      batch; heads, mlp, vocab over model (Megatron)    all-reduce over model (row-parallel
                                                                              outputs), all-gather over model (the
                                                                              embedding table), all-reduce over data
fsdp_tp    data, model      fsdp over data and tp over model (2D)             all of fsdp's and tp's
sp         data, model      tp, plus ``length`` over model outside            all-gather over model (sequence),
                            attention and MLP                                 all-reduce over model (row-parallel
                                                                              outputs) [1]_, all-reduce over data
ep         data, expert     batch over data x expert; experts over expert     all-to-all over expert (token dispatch
                                                                              and return), all-gather over expert,
                                                                              all-reduce (gradients)
fsdp_ep    data, expert     ep's experts and token all-to-all, with every      all-to-all over expert (tokens), all-
                            parameter (experts too) and the optimizer state   gather over data (parameters; experts
                            over data along ``embed``                         only the device's own), all-reduce [1]_
async_tp   data, model      tp's parameters; sp's activations; projections    collective-permute over model (ring
                            as collective matmuls (option collective_matmul)  steps in place of the projections'
                                                                              all-gather / all-reduce), all-gather
                                                                              over model (embedding table, logits'
                                                                              input), all-reduce over model (logits,
                                                                              norm gradients), all-reduce over data
pp         stage, data      ``layers`` (the stacked blocks) over stage,       collective-permute over stage (between
                            batch over data; GPipe, or circular with          stages), all-reduce over stage (the
                            ``repeats=V`` (:mod:`nnx_shard.pipeline`)         activations in and out), all-reduce over
                                                                              data; circular adds all-to-all over stage
                                                                              (the stack's re-layout) [2]_
pp_fsdp    stage, data      pp, plus params over data along ``embed``         pp's and fsdp's; XLA also moves the
                                                                              embedding and head between groups
                                                                              (all-to-all, permutes, an all-gather
                                                                              over stage of the head's weight)
pp_tp      stage, data,     pp, plus tp over model inside each stage          pp's and tp's
           model
cp         data, context    batch; ``length`` over context everywhere, ring   collective-permute over context (ring
                            attention (option ``attention="ring"``)           K/V blocks, zig-zag reorder),
                                                                              all-reduce over data and over context
                                                                              (gradients), all-gather over context
                                                                              (the position embedding's gradient)
fsdp_cp    data, context    fsdp over data and cp over context                all of fsdp's and cp's
=========  ===============  ================================================  ==========================================

The collectives are those the compiled train step of the reference transformer
contains on 8 CPU devices with Explicit mesh axes, where the model spells out
each layout change (tests/test_strategies.py reads them, with the mesh axes
each runs over, from the HLO with :func:`nnx_shard.planner.compiled_collectives`). On Auto axes,
the default of :meth:`Strategy.make_mesh`, XLA's partitioner chooses them and
may use others for the same layouts (e.g. an all-to-all or collective-permute
where a layout changes).

.. [1] The textbook collective here is a reduce-scatter (each device keeps only
   its slice of the summed gradients, or of the sequence under sp). On XLA's
   CPU backend the partitioned train step contains the equivalent all-reduce
   followed by a local slice instead, so that is what the CPU HLO and
   :attr:`Strategy.collectives` show (zero2's names the reduce-scatter it is
   built for). Backends that rewrite that pattern into a reduce-scatter may
   show one instead.

.. [2] The pipeline presets run only on Auto axes (tests/parallel/test_pipeline.py reads
   their collectives there), with a stacked layer axis and the trainer's
   ``microbatches=M`` (at least the number of stages).

.. [3] Read on Auto axes, the default (tests/strategies/test_hsdp.py, which also
   proves hsdp's values equal fsdp's on the same devices): only the gradient
   reduction crosses replicas, once per step, on 1/data slices (the small
   gradients, the norms' scales and the position table, whole, in one
   all-reduce over replica x data). On Explicit axes XLA reduces every gradient
   in one all-reduce over replica x data.

:func:`get` builds a preset by name (:data:`NAMES`), :class:`Strategy` is what it
returns, and :func:`preset` registers a preset of your own under its function's
name. To choose a preset, mesh shape, remat policy and microbatch count by predicted
step time, see :func:`nnx_shard.planner.auto`.

>>> import nnx_shard as ns
>>> s = ns.strategies.get("fsdp_tp")
>>> s.mesh_axes, s.mesh_for(8)
(('data', 'model'), {'data': 4, 'model': 2})
>>> s.rules["embed"], s.rules["heads"]
('data', 'model')
"""

from __future__ import annotations

from nnx_shard.strategies._presets import NAMES, get
from nnx_shard.strategies._strategy import LOGICAL, Strategy, preset

__all__ = ["LOGICAL", "NAMES", "Strategy", "get", "preset"]
