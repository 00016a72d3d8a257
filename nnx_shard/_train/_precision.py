"""Mixed precision for any model: float32 master weights, bfloat16 compute.

:class:`Precision` is given to :class:`~nnx_shard.Trainer`, :func:`~nnx_shard.multistep`
or :func:`~nnx_shard.value_and_grad`. The model and the optimizer state keep their
dtype (the master weights, float32); inside the differentiated loss every float
``nnx.Param`` is read in the compute dtype: the cast is a get-value hook on the
Variable, so it happens where the model reads the parameter (``variable[...]``,
``variable.get_value()``, ``jnp.asarray(variable)``), inside the layer that uses
it, inside a scanned layer's loop body. Gradients flow back through the cast to
the float32 parameters, so they come back float32.

Why per use and not one cast of the whole model at the top of the step (as
Levanter's ``cast_to_compute`` did, Levanter#426): a cast at the top makes a
compute-dtype copy of every parameter that lives until the backward pass has used
it, whatever rematerialization says. Cast per use, a layer's copy is made when the
layer runs, and with remat it is made again in the backward pass instead of kept.
Under fsdp the cast of each shard comes before the all-gather, so the gather moves
compute-dtype bytes (``benchmarks/mixed_precision.py`` measures both).

What stays as it is: integer parameters, Variables that are not ``nnx.Param``
(batch statistics, RNG keys and counts, caches), and every activation the model
computes itself: the reference models keep norms, attention scores and softmax,
logits and the loss in float32. bfloat16 has float32's exponent range, so no loss
scaling is needed; float16 would need it and is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_shard._annotate import path_str
from nnx_shard._errors import UsageError, short

__all__ = ["Precision", "as_precision"]

_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
            "f16": "float16", "half": "float16"}
_HOOK = "on_get_value"


# The float dtypes a step can hold master weights in and compute in; float8/float6/
# float4 are storage formats (no accumulation in them, no optimizer math), and None
# would read as numpy's default, float64.
_USABLE = ("float64", "float32", "bfloat16", "float16")


def _float_dtype(value: Any, what: str) -> np.dtype:
    fix = (f"Fix: e.g. {what}=jnp.float32 or {what}=jnp.bfloat16 (or 'float32', 'bf16'); "
           f"leave {what} out for its default.")
    if value is None:
        raise UsageError(f"Precision({what}=None): a dtype is needed (None is not 'unchanged'). "
                         + fix)
    try:
        dt = jnp.dtype(_ALIASES.get(value, value) if isinstance(value, str) else value)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise UsageError(f"Precision({what}={short(value, 60)}): not a float dtype. " + fix)
    if dt.name not in _USABLE:
        raise UsageError(f"Precision({what}={dt.name}): a storage format, not a dtype to "
                         f"train in (only {', '.join(_USABLE)} are). " + fix)
    return dt


@dataclasses.dataclass(frozen=True)
class Precision:
    """Mixed precision: parameters (master weights and so optimizer state) stored in
    ``params``, read in ``compute`` inside the differentiated loss.

    Pass it to :class:`~nnx_shard.Trainer` or :func:`~nnx_shard.multistep` (whose
    step must take its gradients with :func:`~nnx_shard.value_and_grad`), or to
    :func:`~nnx_shard.value_and_grad` itself. Dtypes are numpy/jax dtypes or their
    names (``"float32"``, ``"bfloat16"``, ``"bf16"``); both are needed (``None`` is
    refused, not read as "unchanged"), and only float64, float32, bfloat16 and float16
    are dtypes to train in (float8/float6/float4 are storage formats; integers and bool
    are refused too). ``compute=float16`` is refused: it needs loss scaling, which
    bfloat16 (float32's exponent range) does not.

    The rules, checked each time the loss is traced (and by ``Trainer`` when it is
    built), each failure one :class:`~nnx_shard._errors.UsageError` naming the paths:

    * every float ``nnx.Param`` of the model is stored in ``params``: a model built
      in another dtype (e.g. a named config with ``param_dtype=bfloat16``) would
      train without the master weights asked for;
    * a module that fixes its own compute dtype (a ``dtype`` attribute, as Flax's
      layers have, or ``cfg.dtype``, as :class:`~nnx_shard.models.Decoder` and
      :class:`~nnx_shard.models.Decoder` have) and holds parameters must name
      ``compute``: one that says float32 would cast the bfloat16 parameters back and
      compute in float32 with rounded weights. Layers with ``dtype=None`` follow
      their inputs. For the reference models: ``DecoderConfig(..., dtype=jnp.bfloat16,
      param_dtype=jnp.float32)`` (such a model already casts each parameter where it
      uses it; ``Precision`` then changes nothing but checks).

    Args:
      params: the dtype parameters (and so optimizer state) are stored in.
      compute: the dtype parameters are read in inside the differentiated loss.

    >>> import jax.numpy as jnp
    >>> from nnx_shard import Precision
    >>> p = Precision(params=jnp.float32, compute="bf16")
    >>> p, p.casts
    (Precision(params=float32, compute=bfloat16), True)
    >>> Precision(compute=jnp.float16)
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: Precision(compute=float16) needs loss scaling (float16 overflows above 65504 and loses small gradients), which nnx_shard does not do. Fix: compute=jnp.bfloat16, which has float32's exponent range and trains without loss scaling.
    """

    params: Any = jnp.float32
    compute: Any = jnp.bfloat16

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", _float_dtype(self.params, "params"))
        object.__setattr__(self, "compute", _float_dtype(self.compute, "compute"))
        if self.compute == jnp.float16:
            raise UsageError(
                "Precision(compute=float16) needs loss scaling (float16 overflows above 65504 "
                "and loses small gradients), which nnx_shard does not do. Fix: "
                "compute=jnp.bfloat16, which has float32's exponent range and trains without "
                "loss scaling."
            )

    def __repr__(self) -> str:
        return f"Precision(params={self.params.name}, compute={self.compute.name})"

    @property
    def casts(self) -> bool:
        """Whether parameters are read in another dtype than they are stored in."""
        return self.params != self.compute

    def check(self, model: Any) -> None:
        """Raises a :class:`~nnx_shard._errors.UsageError` listing every float
        parameter not stored in ``params`` and every module whose own compute
        dtype is not ``compute`` (see the class docstring); returns quietly else.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from nnx_shard import Precision
        >>> Precision().check(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))   # dtype=None: follows
        >>> Precision().check(nnx.Linear(2, 3, dtype=jnp.float32, rngs=nnx.Rngs(0)))
        Traceback (most recent call last):
        ...
        nnx_shard._errors.UsageError: Precision(params=float32, compute=bfloat16): 1 module computes in another dtype than bfloat16 and would cast its parameters back:
        - (the model) (Linear) has dtype=float32
        Fix: build those modules with dtype=bfloat16 (DecoderConfig / ReferenceConfig: dtype=jnp.bfloat16, param_dtype=jnp.float32), or dtype=None to follow the inputs.
        """
        stored: list[str] = []
        modules: list[str] = []
        for path, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Param):
                dt = _float_of(node.get_raw_value())
                if dt is not None and dt != self.params:
                    stored.append(f"{path_str(path) or '(the model)'}: {dt.name}")
            elif self.casts and isinstance(node, nnx.Module):
                dt = _module_dtype(node)
                if dt is not None and dt != self.compute and _owns_params(node):
                    where = path_str(path) or "(the model)"
                    modules.append(f"{where} ({type(node).__name__}) has dtype={dt.name}")
        if stored:
            raise UsageError(
                f"{self!r}: {len(stored)} float parameter{'s are' if len(stored) > 1 else ' is'} "
                f"not stored in {self.params.name}, so the master weights would not be "
                f"{self.params.name}:\n" + "\n".join(f"- {s}" for s in stored[:20])
                + ("\n- ..." if len(stored) > 20 else "")
                + f"\nFix: build the model with param_dtype={self.params.name} (e.g. "
                f"DecoderConfig(..., param_dtype=jnp.{self.params.name})), or give "
                "Precision(params=...) the dtype the parameters have."
            )
        if modules:
            n = len(modules)
            raise UsageError(
                f"{self!r}: {n} module{'s compute' if n > 1 else ' computes'} in another "
                f"dtype than {self.compute.name} and would cast {'their' if n > 1 else 'its'} "
                "parameters back:\n" + "\n".join(f"- {m}" for m in modules[:20])
                + ("\n- ..." if n > 20 else "")
                + f"\nFix: build those modules with dtype={self.compute.name} (DecoderConfig / "
                f"ReferenceConfig: dtype=jnp.{self.compute.name}, "
                f"param_dtype=jnp.{self.params.name}), or dtype=None to follow the inputs."
            )

    @contextlib.contextmanager
    def reading(self, model: Any) -> Iterator[None]:
        """Within the block, every float ``nnx.Param`` of ``model`` reads in the
        compute dtype (a get-value hook on each Variable, removed on exit); the
        stored values are untouched. Used inside the differentiated loss by
        :func:`~nnx_shard.value_and_grad`; it checks the model first (:meth:`check`).

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from nnx_shard import Precision
        >>> layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        >>> with Precision().reading(layer):
        ...     layer.kernel[...].dtype, layer(jnp.ones((1, 2), jnp.bfloat16)).dtype
        (dtype(bfloat16), dtype(bfloat16))
        >>> layer.kernel[...].dtype, layer.kernel.get_metadata("on_get_value", None)
        (dtype('float32'), None)
        """
        self.check(model)
        if not self.casts:
            yield
            return
        hook = _reader(self.compute)
        hooked: list[tuple[nnx.Variable, Any]] = []
        seen: set[int] = set()
        try:
            for _, node in nnx.iter_graph(model):
                if (isinstance(node, nnx.Param) and id(node) not in seen
                        and _float_of(node.get_raw_value()) is not None):
                    seen.add(id(node))
                    old = node.get_metadata(_HOOK, None)
                    hooks = (*old, hook) if isinstance(old, tuple) else (
                        (old, hook) if old is not None else hook)
                    node.set_metadata(_HOOK, hooks)
                    hooked.append((node, old))
            yield
        finally:
            for node, old in hooked:
                if old is None:
                    node.del_metadata(_HOOK)
                else:
                    node.set_metadata(_HOOK, old)


def as_precision(value: Any, where: str = "precision") -> Precision | None:
    """``value`` checked: ``None`` or a :class:`Precision` (anything else is a
    :class:`~nnx_shard._errors.UsageError` saying how to build one).

    >>> as_precision(None) is None, as_precision(Precision()).compute.name
    (True, 'bfloat16')
    >>> as_precision("bf16")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: precision must be an nnx_shard.Precision or None, got 'bf16'. Fix: precision=ns.Precision(params=jnp.float32, compute=jnp.bfloat16).
    """
    if value is None or isinstance(value, Precision):
        return value
    raise UsageError(f"{where} must be an nnx_shard.Precision or None, got {value!r}. Fix: "
                     f"{where.rpartition(' ')[2]}=ns.Precision(params=jnp.float32, "
                     "compute=jnp.bfloat16).")


def _float_of(x: Any) -> np.dtype | None:
    dt = getattr(x, "dtype", None)
    if dt is None or not isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct):
        return None
    dt = jnp.dtype(dt)
    return dt if jnp.issubdtype(dt, jnp.floating) else None


def _module_dtype(module: Any) -> np.dtype | None:
    """The compute dtype a module fixes for itself: its ``dtype`` attribute (Flax's
    layers), else its config's (the reference models); ``None`` if it follows its
    inputs or says nothing."""
    for owner in (module, getattr(module, "cfg", None)):
        dt = getattr(owner, "dtype", None) if owner is not None else None
        if dt is not None:
            try:
                dt = jnp.dtype(dt)
            except TypeError:
                return None
            return dt if jnp.issubdtype(dt, jnp.floating) else None
    return None


def _owns_params(module: Any) -> bool:
    """Whether ``module`` holds a float ``nnx.Param`` as one of its own attributes."""
    return any(isinstance(v, nnx.Param) and _float_of(v.get_raw_value()) is not None
               for v in vars(module).values())


@functools.cache
def _reader(compute: np.dtype) -> Callable[[Any, Any], Any]:
    # One function per dtype: the hook is Variable metadata, part of the pytree
    # structure of any state split inside the loss, which must compare equal across
    # traces.
    def read(variable: Any, value: Any) -> Any:
        if isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jnp.floating) \
                and value.dtype != compute:
            return value.astype(compute)
        return value

    read.__qualname__ = f"Precision.read_as_{compute.name}"
    return read
