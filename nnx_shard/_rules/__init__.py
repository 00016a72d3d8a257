"""Rules: the table that turns logical axis names into mesh axes.

A rules table is an ordered list of entries ``(logical name, placement)``. A
placement is

* a mesh axis name (``"model"``): shard the dimension over that axis;
* a tuple of mesh axis names (``("data", "fsdp")``): shard over their product;
* ``None``: replicate the dimension;
* ``PartitionSpec.UNCONSTRAINED`` (activations only): let the compiler choose.

Resolution (:meth:`Rules.spec`) is the one of Flax linen's
``logical_to_mesh_axes`` and MaxText: the table is walked **in order**, and an
entry ``(logical, placement)`` applies to the dimension carrying that logical
name when the dimension is still unassigned and none of the entry's mesh axes
shards another dimension yet. A logical name given more than once therefore
lists fallbacks (the first that applies wins), and an earlier entry claims a
mesh axis before a later one, whatever the order of the array's dimensions.
Flax NNX's own resolver turns the table into a dict, where the *last* entry of
a repeated name wins and the others are dropped; we keep linen's table order.

Two checks are ours: an entry whose mesh axis is not in the mesh, or whose axes'
product does not divide the dimension, does not fit, and the walk goes on to the
next entry. Where no entry fits a named dimension, Flax silently replicates it;
we raise a ``ShardingError`` that names the array, its shape and logical names,
every entry tried and why it failed, and a fix (give the table a ``None`` entry
for that name, or ``Rules(..., indivisible="replicate")`` for dimensions that
only fail to divide). A mesh axis of size 1 shards nothing, so when nothing else
fits, an entry blocked only by an already used size-1 axis applies without it.
A logical name with no entry that is itself a mesh axis maps to that axis.

Two ways to write a table:

* ``Rules({...})`` / ``Rules([(logical, value), ...])``: a value is a placement
  (a product of axes is a **tuple**) or :class:`Fallbacks` of placements, the
  ordered candidates of that name (they become consecutive entries). A plain
  list is refused as ambiguous: Flax and MaxText read it as a product.
* ``Rules.from_pairs(pairs)`` and :meth:`Rules.from_file` read tables as Flax and
  MaxText write them: a list **or** tuple value is a product of mesh axes,
  ``[]`` / ``None`` / ``""`` replicate, and a repeated name is the next candidate.

The package: :mod:`~nnx_shard._rules._values` (placements and their forms),
:mod:`~nnx_shard._rules._options` (the table of execution options),
:mod:`~nnx_shard._rules._files` (reading rules files), :mod:`~nnx_shard._rules._resolve`
(the table walk) and :mod:`~nnx_shard._rules._table` (the ``Rules`` class); every public
name is importable from ``nnx_shard._rules``.
"""

from nnx_shard._rules._files import MAX_FILE_BYTES as MAX_FILE_BYTES
from nnx_shard._rules._files import MAX_YAML_NODES as MAX_YAML_NODES
from nnx_shard._rules._options import OPTIONS as OPTIONS
from nnx_shard._rules._options import Option as Option
from nnx_shard._rules._options import declare_option as declare_option
from nnx_shard._rules._options import known_options as known_options
from nnx_shard._rules._options import option_row as option_row
from nnx_shard._rules._table import Rules as Rules
from nnx_shard._rules._table import as_rules as as_rules
from nnx_shard._rules._values import UNCONSTRAINED as UNCONSTRAINED
from nnx_shard._rules._values import Fallbacks as Fallbacks
from nnx_shard._rules._values import Indivisible as Indivisible
from nnx_shard._rules._values import LogicalNames as LogicalNames
from nnx_shard._rules._values import Placement as Placement
from nnx_shard._rules._values import RuleValue as RuleValue
from nnx_shard._rules._values import describe as describe

__all__ = ["MAX_FILE_BYTES", "MAX_YAML_NODES", "OPTIONS", "Fallbacks", "Option", "Rules",
           "declare_option", "known_options", "option_row"]
