"""A planner that chooses: strategy preset x mesh shape x remat policy x microbatches.

:func:`auto` (also ``ns.planner.auto``, and ``nnx-shard plan --auto``)
enumerates every preset of :data:`nnx_shard.strategies.NAMES` on every
factorisation of the device count over the preset's mesh axes, drops what
cannot be laid out (the preset's ``check`` raises, or the batch does not divide)
or does not fit in the device memory, and ranks the rest by a cost model read
from the compiled train step (the call ``Trainer.fit`` makes: two steps of
``value_and_grad(loss)`` + ``optimizer.update`` and the NaN guard, compiled from
abstract inputs, nothing allocated; per-step figures are the call's halved)::

    predicted step = matmul FLOPs per device / peak FLOP/s
                   + collective bytes sent per device / link bytes/s
                   + collectives per step x link latency
                   + memory bytes per device / memory bytes/s

* FLOPs: the ``dot`` operations of the compiled per-device HLO,
  ``2 x |result| x |contracted dims|`` each, times the trip count of every loop
  around it (scanned layers, microbatches); elementwise work is left out.
* Collective bytes: each collective of the HLO (read with
  :func:`~nnx_shard.planner._costs.compiled_collectives`) as a ring algorithm sends
  them over its ``n`` devices: all-reduce ``2 (n-1)/n x size``, all-gather and
  all-to-all ``(n-1)/n x size``, reduce-scatter ``(n-1) x size``,
  collective-permute ``size``; times the loop trip counts.
* Memory bytes: what each operation outside a fusion reads and writes (a
  fusion's operands and result), loop-weighted; a slice of a stacked buffer
  counts as the slice. An approximation of XLA's ``bytes accessed``: it
  matters for steps bound by memory traffic (optimizer updates of replicated
  state, small matmuls on CPU).
* Memory: XLA's buffer assignment (arguments + temp + outputs - donated) of that
  call compiled on simulated CPU devices, the guard's copy of the model and
  optimizer state included: a GPU/TPU compile can differ.

The search is bounded: a mesh with a size-1 axis beyond the first repeats a
preset with fewer axes and is skipped; a candidate whose formula estimate
(``nnx-shard plan``'s, which under-counts XLA's figure) already exceeds the
memory is dropped without compiling; remat policies and microbatches (which
trade time for memory in this cost model) are tried only for layouts whose
plain step does not fit, cheapest first, stopping at the first that fits; and
at most ``max_compiles`` compiles run. :attr:`Plan.pruned` says what was
skipped. Compiles are cached by their configuration.

The package, one job a module: :mod:`~nnx_shard.planner._hardware` (profiles,
calibration), :mod:`~nnx_shard.planner._costs` (the HLO reader),
:mod:`~nnx_shard.planner._compile` (the train step compiled from abstract inputs,
here or in a child Python), :mod:`~nnx_shard.planner._formula` (the formula's
bytes), :mod:`~nnx_shard.planner._plan` (candidates and the plan),
:mod:`~nnx_shard.planner._cache` (compiles kept across runs), and for :func:`auto`:
:mod:`~nnx_shard.planner._options` (its options), :mod:`~nnx_shard.planner._problem` (the
model and options it plans for), :mod:`~nnx_shard.planner._candidates` (the preset x mesh
candidates), :mod:`~nnx_shard.planner._evaluate` (a candidate's figures: compiled,
cached or a twin's), :mod:`~nnx_shard.planner._explore` (the phases, pruning and ranking)
and :mod:`~nnx_shard.planner._search` (:func:`auto` itself).

>>> from nnx_shard.planner import hardware
>>> hardware("h100-sxm").peak_flops
989000000000000.0
"""


from nnx_shard.planner._compile import compiled_memory
from nnx_shard.planner._costs import (
    Collective,
    MemorySplit,
    compiled_collectives,
    memory_split,
    partitioned_hlo,
)
from nnx_shard.planner._hardware import Hardware, hardware
from nnx_shard.planner._plan import Candidate, Plan
from nnx_shard.planner._search import AutoOptions, NothingFits, auto
from nnx_shard.planner._user import UserModel

__all__ = ["AutoOptions", "Candidate", "Collective", "Hardware", "MemorySplit", "NothingFits", "Plan",
           "UserModel", "auto", "compiled_collectives", "compiled_memory", "hardware",
           "memory_split", "partitioned_hlo"]
