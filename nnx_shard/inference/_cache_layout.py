"""The key/value cache's layout: :func:`generation_rules`, the table generation runs
under (derived from a training layout), and :func:`explain_cache`, the cache it lays out
by that table, planned without allocating anything. Documented where public:
:mod:`nnx_shard.inference`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from nnx_shard._axes import mesh_sizes
from nnx_shard._errors import UsageError
from nnx_shard._mesh import make_mesh
from nnx_shard._report import Report, layout_rows
from nnx_shard._rules import Rules, as_rules
from nnx_shard.inference._checks import check_batch, check_model
from nnx_shard.inference._programs import abstract_cache

__all__ = ["DROPPED_OPTIONS", "explain_cache", "generation_rules"]

#: Execution options of training layouts that generation does not use: the
#: sequence of new tokens is one position long, so it is neither split over a
#: context axis (ring attention) nor gathered in ring steps (collective
#: matmuls), and the layers run in one loop on every device (no pipeline).
DROPPED_OPTIONS = ("attention", "collective_matmul", "pipeline")


def generation_rules(rules: Rules | Mapping[str, Any]) -> Rules:
    """The table generation runs under: ``rules`` with the activations'
    ``length`` replicated (a decode step has one position; the cache's
    positions are ``cache_length``), the ``layers`` axis of stacked caches
    replicated (the decode loop scans over it: a split would gather each
    layer's slice at every step), without the options of
    :data:`DROPPED_OPTIONS`, and with the cache's names derived where the table
    lacks them: ``cache_batch`` as ``batch``, ``cache_kv_heads`` as ``kv_heads``
    (else ``heads``), ``cache_length`` and ``cache_head_dim`` replicated.

    Parameters keep the layout they have: under a pipeline preset the layers
    split over ``stage`` are gathered by XLA as the loop reaches them
    (generation runs no pipeline schedule).

    Args:
      rules: a :class:`~nnx_shard.Rules` table or a mapping of logical name to mesh
        axes: the training layout.

    Returns:
      A new :class:`~nnx_shard.Rules`; ``rules`` is not changed.

    >>> from nnx_shard import Rules
    >>> from nnx_shard.inference import generation_rules
    >>> r = generation_rules(Rules({"batch": "data", "heads": "model", "length": "model"}))
    >>> r["length"], r["cache_batch"], r["cache_kv_heads"], r["cache_length"]
    (None, 'data', 'model', None)
    """
    rules = as_rules(rules)
    derived: dict[str, Any] = {}
    if "cache_batch" not in rules:
        derived["cache_batch"] = rules["batch"] if "batch" in rules else None
    if "cache_kv_heads" not in rules:
        source = next((n for n in ("kv_heads", "heads") if n in rules), None)
        derived["cache_kv_heads"] = rules[source] if source else None
    for name in ("cache_length", "cache_head_dim"):
        if name not in rules:
            derived[name] = None
    out = rules | {"length": None, "layers": None} | derived
    return out.with_options(**dict.fromkeys(DROPPED_OPTIONS))


def explain_cache(model: Any, mesh: Mesh | AbstractMesh | str | Mapping[str, int],
                  rules: Rules | Mapping[str, Any], *, batch: int, length: int) -> Report:
    """The key/value cache :func:`generate` allocates for ``batch`` sequences of
    ``length`` positions (prompt + new tokens), laid out by ``rules`` on
    ``mesh``: one row per cache array with its logical names, spec and bytes
    (total and per device), computed without allocating anything.
    ``model`` may be abstract (``nnx.eval_shape`` or
    :func:`nnx_shard.abstract_init`) and ``mesh`` a ``jax.sharding.AbstractMesh``
    (plan a mesh of any size); the per-device bytes are what the compiled
    prefill program outputs (XLA's ``memory_analysis``).

    Args:
      model: a module with ``init_cache`` and ``decode``, concrete or abstract.
      mesh: a mesh, an ``AbstractMesh``, or its axes (``"data=4,model=2"``).
      rules: the layout's rules (before :func:`generation_rules`).
      batch: sequences in the cache (a positive int).
      length: positions per sequence, prompt and new tokens (a positive int).

    Returns:
      A :class:`~nnx_shard.Report` of the cache arrays.

    >>> import jax
    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> from nnx_shard.inference import explain_cache
    >>> from nnx_shard.models import Decoder, get_config
    >>> model = nnx.eval_shape(lambda: Decoder(get_config("llama3-8b"), rngs=nnx.Rngs(0)))
    >>> mesh = jax.sharding.AbstractMesh((4, 8), ("data", "model"))
    >>> report = explain_cache(model, mesh, ns.strategies.get("tp").rules, batch=8, length=8192)
    >>> report.total_bytes // 2**20, report.param_bytes_per_device // 2**20   # MiB
    (8192, 256)
    >>> key = report.rows[0]
    >>> key.path, key.shape, key.spec
    ('blocks/attn/cached_key', (32, 8, 8, 8192, 128), P(None, 'data', 'model', None, None))
    """
    check_model(model, "explain_cache")
    for name, value in (("batch", batch), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise UsageError(f"explain_cache: {name} must be a positive int, got {value!r}. "
                             f"Fix: e.g. {name}=8.")
    if not isinstance(mesh, AbstractMesh):
        mesh = make_mesh(mesh)
    gen_rules = generation_rules(rules)
    check_batch(int(batch), mesh, gen_rules, "explain_cache")
    graphdef, old, rest = nnx.split(model, nnx.Cache, ...)  # type: ignore[misc]
    _, cache = abstract_cache(graphdef, old, rest, int(batch), int(length))
    return Report(rows=tuple(layout_rows(cache, mesh, gen_rules)), mesh_shape=mesh_sizes(mesh))
