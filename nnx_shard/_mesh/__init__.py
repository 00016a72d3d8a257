"""Meshes and where arrays go on them, in three modules:

* :mod:`~nnx_shard._mesh._build`: :func:`parse_axes` (the one reader of mesh text such
  as ``"data=4,model=2"``, whose docstring states the grammar), :func:`make_mesh` (from
  such text, a dict or a Mesh; hybrid meshes over :func:`granules` with ``across=``) and
  :func:`mesh_str`, its text form;
* :mod:`~nnx_shard._mesh._context`: the one execution :class:`Context` (the mesh and
  rules of :func:`use`, what ``multistep``, ``value_and_grad`` and the pipeline hand
  down), read by :func:`context` (and its views :func:`current` and :func:`option`),
  and :func:`constrain` for activations;
* :mod:`~nnx_shard._mesh._placement`: :func:`shardings` of a model's Variables, one
  sharding applied to a traced value, bytes per device.

Every name is importable from ``nnx_shard._mesh`` directly.
"""

from nnx_shard._mesh._build import granules, hybrid_devices, make_mesh, mesh_str, parse_axes
from nnx_shard._mesh._context import (
    CallLog,
    Calls,
    Context,
    called,
    constrain,
    context,
    current,
    entered,
    option,
    use,
    watching,
)
from nnx_shard._mesh._placement import (
    apply_sharding,
    as_state,
    bytes_per_device,
    nbytes,
    shardings,
    variable_spec,
)

__all__ = ["CallLog", "Calls", "Context", "apply_sharding", "as_state", "bytes_per_device", "called",
           "constrain", "context", "current", "entered", "granules", "hybrid_devices", "make_mesh",
           "mesh_str", "nbytes", "option", "parse_axes", "shardings", "use", "variable_spec",
           "watching"]
