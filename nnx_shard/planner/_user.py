"""The planner on a model of the user's own: a factory, a loss ``loss(model, batch)
-> scalar`` and the batch's shapes, with no ``forward`` or reference config needed.

:class:`UserModel` holds them, checked once (the loss's signature, its scalar output
on the abstract model and batch, one global batch size); :func:`parse_batch_spec`
reads the command line's ``--batch-spec`` text. :func:`nnx_shard.planner.auto`
takes them as ``auto(factory, loss=..., batch_spec=..., aliases=...)`` and compiles
each candidate with :func:`~nnx_shard.planner._compile.compile_step` on this batch
and loss, in this process.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

from nnx_shard._axes import entry_axes
from nnx_shard._errors import ShardingError, UsageError
from nnx_shard.planner._compile import compile_step
from nnx_shard.strategies._presets import get
from nnx_shard.strategies._strategy import Strategy

__all__ = ["UserModel", "parse_batch_spec"]

_LEAF = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*=\s*([a-z]+[0-9]*)\s*\[\s*([0-9,\s]*)\]\s*$")
_SPEC_FIX = "write name=dtype[dims],... e.g. inputs=int32[16,128],targets=int32[16,128]"


def _dtype(name: str, where: str) -> Any:
    try:
        return jnp.dtype(name)
    except TypeError:
        raise UsageError(f"batch spec {where}: {name!r} is not a dtype. Fix: e.g. int32, "
                         "float32, bfloat16") from None


def parse_batch_spec(text: str) -> dict[str, jax.ShapeDtypeStruct]:
    """``--batch-spec`` text as a dict of ``jax.ShapeDtypeStruct``, one step's global
    batch: comma-separated ``name=dtype[dim,dim,...]`` entries, the first dimension
    of each the global batch. A dotted name nests (``a.b=...`` is ``{"a": {"b": ...}}``).

    >>> spec = parse_batch_spec("inputs=int32[16,128],targets=int32[16,128]")
    >>> spec["inputs"].shape, spec["targets"].dtype
    ((16, 128), dtype('int32'))
    >>> parse_batch_spec("x=float32[8")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: batch spec 'x=float32[8': 'x=float32[8' is not name=dtype[dims]. Fix: write name=dtype[dims],... e.g. inputs=int32[16,128],targets=int32[16,128]
    """
    out: dict[str, Any] = {}
    # Split on the commas between entries, not those inside [...].
    items = [m.group(0) for m in re.finditer(r"[^,\[]+(\[[^\]]*\]?)?", text)]
    for item in (i.strip() for i in items):
        if not item:
            continue
        m = _LEAF.match(item)
        if m is None:
            raise UsageError(f"batch spec {text!r}: {item!r} is not name=dtype[dims]. "
                             f"Fix: {_SPEC_FIX}")
        name, dtype, dims = m.groups()
        shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d)
        if not shape or min(shape) < 1:
            raise UsageError(f"batch spec {text!r}: {item!r} needs positive dims, the first "
                             f"the global batch. Fix: {_SPEC_FIX}")
        node = out
        *parents, last = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"batch spec {text!r}: {name!r} nests under a leaf. "
                                 f"Fix: {_SPEC_FIX}")
        if last in node:
            raise UsageError(f"batch spec {text!r}: {name!r} is given twice. Fix: {_SPEC_FIX}")
        node[last] = jax.ShapeDtypeStruct(shape, _dtype(dtype, repr(item)))
    if not out:
        raise UsageError(f"batch spec {text!r} is empty. Fix: {_SPEC_FIX}")
    return out


def _as_spec(batch: Any) -> Any:
    """A batch spec (text, or a pytree of ``ShapeDtypeStruct`` / arrays / ``"int32[8,16]"``
    leaves) as a pytree of ``jax.ShapeDtypeStruct``."""
    if isinstance(batch, str):
        return parse_batch_spec(batch)

    def leaf(path: Any, x: Any) -> jax.ShapeDtypeStruct:
        if isinstance(x, str):
            return next(iter(parse_batch_spec(f"x={x}").values()))
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
        raise UsageError(f"batch_spec{jax.tree_util.keystr(path)} = {x!r} is not a shape and "
                         "dtype. Fix: a jax.ShapeDtypeStruct((batch, ...), dtype), an array, "
                         "or 'int32[16,128]'")

    return jax.tree_util.tree_map_with_path(
        leaf, batch, is_leaf=lambda x: isinstance(x, str | jax.ShapeDtypeStruct))


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


@dataclasses.dataclass(frozen=True, eq=False)
class UserModel:
    """A model of the user's own for :func:`nnx_shard.planner.auto`: ``factory()``
    builds it, ``loss(model, batch)`` returns the scalar to minimise (as
    :class:`nnx_shard.Trainer` calls it), ``batch`` is one step's global batch as a
    pytree of ``jax.ShapeDtypeStruct`` (or arrays, or ``"int32[16,128]"`` strings, or
    :func:`parse_batch_spec` text), and ``aliases`` map the model's own logical
    names onto the presets' (:meth:`nnx_shard.strategies.Strategy.with_rules`). The batch is
    laid out as ``Trainer.fit`` places it by default: every leaf's first dimension
    on ``batch``. :meth:`check` validates all of it on the abstract model.

    Attributes:
      factory: a zero-argument function that builds the model.
      loss: ``loss(model, batch) -> scalar``.
      batch: one step's global batch: a pytree of ``jax.ShapeDtypeStruct`` (or arrays,
        or ``"int32[16,128]"`` strings), or ``"x=int32[16,128],y=..."`` text.
      aliases: the model's logical names mapped onto the presets' (``None``: none).

    >>> from flax import nnx
    >>> import optax
    >>> from nnx_shard.planner import UserModel
    >>> def loss(model, batch):
    ...     return optax.l2_loss(model(batch["x"]), batch["y"]).mean()
    >>> user = UserModel(lambda: nnx.Linear(4, 2, rngs=nnx.Rngs(0)), loss,
    ...                  "x=float32[8,4],y=float32[8,2]").check()
    >>> user.global_batch, user.seq
    (8, 4)
    >>> UserModel(lambda: nnx.Linear(4, 2, rngs=nnx.Rngs(0)), lambda m: 0.0,
    ...           "x=float32[8,4]").check()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: auto: the loss ...<lambda> takes (m) but is called loss(model, batch) (as Trainer calls it). Fix: def loss(model, batch): return a scalar
    """

    factory: Callable[[], Any]
    loss: Callable[[Any, Any], Any]
    batch: Any
    aliases: Mapping[str, str] | None = None

    @property
    def spec(self) -> Any:
        """The batch as a pytree of ``jax.ShapeDtypeStruct``."""
        return _as_spec(self.batch)

    @property
    def global_batch(self) -> int:
        """The first dimension every leaf of the batch shares."""
        leaves = jax.tree.leaves(self.spec)
        sizes = {x.shape[0] if x.shape else None for x in leaves}
        if not leaves or len(sizes) != 1 or None in sizes:
            raise UsageError(f"auto: the batch spec's leaves have first dimensions "
                             f"{sorted(map(str, sizes))}: each leaf needs the same leading "
                             "global-batch dimension. Fix: e.g. "
                             "inputs=int32[16,128],targets=int32[16,128]")
        return int(sizes.pop())  # type: ignore[arg-type]

    @property
    def seq(self) -> int:
        """The second dimension of the first leaf of rank 2 or more (1 if none): the
        sequence length the plan reports."""
        for x in jax.tree.leaves(self.spec):
            if len(x.shape) >= 2:
                return int(x.shape[1])
        return 1

    def strategy(self, name: str) -> Strategy:
        """Preset ``name`` with :attr:`aliases` applied."""
        strat = get(name)
        return strat.with_rules(aliases=self.aliases) if self.aliases else strat

    def key(self) -> str:
        """What the compile cache keys this model on (the functions by name and id,
        the batch by shapes and dtypes, the aliases)."""
        leaves = [(jax.tree_util.keystr(p), list(x.shape), np.dtype(x.dtype).name)
                  for p, x in jax.tree_util.tree_flatten_with_path(self.spec)[0]]
        return (f"{_name(self.factory)}#{id(self.factory)}|{_name(self.loss)}#{id(self.loss)}"
                f"|{leaves}|{sorted((self.aliases or {}).items())}")

    def abstract(self) -> Any:
        """``nnx.eval_shape(factory)``, the factory's own error as one line."""
        try:
            # Logical names are not mesh axes: Flax must not place them eagerly here.
            with nnx.use_eager_sharding(False):
                return nnx.eval_shape(self.factory)
        except Exception as e:
            raise UsageError(f"auto: the model factory {_name(self.factory)} raised "
                             f"{type(e).__name__}: {' '.join(str(e).split())[:300]}. Fix: a "
                             "zero-argument function returning the nnx.Module") from e

    def check(self) -> UserModel:
        """Checks the factory, the loss's signature and scalar result on the abstract
        model and batch, and the batch; returns ``self``. Raises :class:`UsageError`."""
        if not callable(self.factory):
            raise UsageError(f"auto: the model {self.factory!r} is not callable. Fix: a "
                             "zero-argument factory returning the nnx.Module")
        if not callable(self.loss):
            raise UsageError(f"auto: loss {self.loss!r} is not callable. Fix: def loss(model, "
                             "batch): return a scalar")
        try:
            sig = inspect.signature(self.loss)
        except (TypeError, ValueError):
            sig = None
        if sig is not None:
            try:
                sig.bind(None, None)
            except TypeError:
                raise UsageError(
                    f"auto: the loss {_name(self.loss)} takes ({', '.join(sig.parameters)}) "
                    "but is called loss(model, batch) (as Trainer calls it). Fix: def "
                    "loss(model, batch): return a scalar") from None
        spec, _ = self.spec, self.global_batch
        self.abstract()  # the factory's own error first, named as the factory's
        for a, v in (self.aliases or {}).items():
            if not (isinstance(a, str) and isinstance(v, str)):
                raise UsageError(f"auto: alias {a!r}: {v!r} is not model name -> logical name. "
                                 "Fix: e.g. aliases={'fsdp': 'embed', 'tp': 'mlp'}")

        def run(batch: Any) -> Any:
            return self.loss(self.factory(), batch)

        try:
            with nnx.use_eager_sharding(False):
                out = nnx.eval_shape(run, spec)
        except UsageError:
            raise
        except Exception as e:
            raise UsageError(
                f"auto: loss(model, batch) on the batch spec raised {type(e).__name__}: "
                f"{' '.join(str(e).split())[:300]}. Fix: a batch spec with the keys, shapes "
                "and dtypes the loss reads") from e
        leaves = jax.tree.leaves(out)
        if len(leaves) != 1 or leaves[0].shape != ():
            shapes = [tuple(x.shape) for x in leaves]
            raise UsageError(f"auto: the loss {_name(self.loss)} returned {shapes}, not a "
                             "scalar. Fix: reduce it, e.g. return per_token_loss.mean()")
        return self

    def check_names(self, abstract: Any, names: list[str]) -> None:
        """Raises the first preset's missing-rule error (with its alias fix) when the
        model names logical axes none of the presets ``names`` has a rule for, as one
        line, instead of dropping every layout for the same reason."""
        errors = []
        for name in names:
            try:
                self.strategy(name).check_names(abstract)
            except ShardingError as e:
                errors.append(e)
            else:
                return
        if errors:
            raise UsageError(f"auto: {' '.join(str(errors[0]).split())} With auto: "
                             "aliases={...}; on the command line: nnx-shard plan --alias "
                             "name=logical,...") from None

    def batch_problem(self, strat: Strategy, sizes: Mapping[str, int],
                      microbatches: int) -> str | None:
        """Why this batch cannot be laid out under ``strat`` on ``sizes`` with
        ``microbatches`` (``None``: it can)."""
        mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
        for path, x in jax.tree_util.tree_flatten_with_path(self.spec)[0]:
            where = f"batch{jax.tree_util.keystr(path)}"
            try:
                spec = strat.rules.spec(("batch", *(None,) * (len(x.shape) - 1)),
                                        shape=x.shape, mesh=mesh, path=where)
            except ShardingError as e:
                return (f"{where} {list(x.shape)} cannot be laid out: "
                        f"{' '.join(str(e).split())[:200]}")
            entry = next(iter(spec), None)
            axes = entry_axes(entry)
            rows = x.shape[0] // math.prod(sizes[a] for a in axes)
            if rows % microbatches:
                return f"{microbatches} microbatches do not divide the {rows} rows per device"
        return None

    def compile(self, strategy: str, sizes: Mapping[str, int], *, optimizer: str,
                microbatches: int) -> dict[str, Any]:
        """:func:`~nnx_shard.planner._compile.compile_step` of this model, loss and
        batch under preset ``strategy`` (aliases applied) on mesh ``sizes``."""
        return compile_step(self.factory, self.strategy(strategy), sizes, batch=self.global_batch,
                            seq=self.seq, optimizer=optimizer, microbatches=microbatches,
                            loss=self.loss, batch_spec=self.spec)


def spec_text(spec: Any) -> str:
    """A batch spec as ``--batch-spec`` text (:func:`parse_batch_spec` reads it back).

    >>> spec_text(parse_batch_spec("x=int32[8,16],y.mask=bool[8]"))
    'x=int32[8,16],y.mask=bool[8]'
    """
    def name(path: Any) -> str:
        return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                        for k in path)

    return ",".join(f"{name(p)}={np.dtype(x.dtype).name}[{','.join(map(str, x.shape))}]"
                    for p, x in jax.tree_util.tree_flatten_with_path(spec)[0])


def user_request(user: UserModel) -> dict[str, Any]:
    """What a plan of ``user`` records of it (its JSON ``request`` fields)."""
    return {"factory": _name(user.factory), "loss": _name(user.loss),
            "batch_spec": spec_text(user.spec), "aliases": dict(user.aliases or {})}


def user_python(request: Mapping[str, Any], strategy: str, mesh: Mapping[str, int],
                microbatches: int) -> str:
    """Python that trains a user's model with a chosen candidate.

    >>> print(user_python({"factory": "m.make", "loss": "m.loss", "optimizer": "adamw",
    ...                    "batch_spec": "x=int32[8,16]", "aliases": {"fsdp": "embed"}},
    ...                   "fsdp", {"data": 8}, 1))  # doctest: +ELLIPSIS
    import optax
    <BLANKLINE>
    import nnx_shard as ns
    from m import loss, make
    <BLANKLINE>
    strategy = ns.strategies.get('fsdp').with_rules(aliases={'fsdp': 'embed'})
    ...
    """
    fmod, _, fname = str(request["factory"]).rpartition(".")
    lmod, _, lname = str(request["loss"]).rpartition(".")
    imports = (f"from {fmod} import {', '.join(sorted({fname, lname}))}\n" if fmod == lmod
               else f"from {fmod} import {fname}\nfrom {lmod} import {lname}\n")
    aliases = request.get("aliases") or {}
    strat = f"ns.strategies.get({strategy!r})" + (
        f".with_rules(aliases={dict(aliases)!r})" if aliases else "")
    sizes = ", ".join(f'"{k}": {v}' for k, v in mesh.items())
    return (
        f"import optax\n\nimport nnx_shard as ns\n{imports}\n"
        f"strategy = {strat}\n"
        f"mesh = ns.make_mesh({{{sizes}}})\n"
        f"model = ns.sharded_init({fname}, mesh, strategy)\n"
        f"opt = ns.sharded_optimizer(model, optax.{request.get('optimizer', 'adamw')}(1e-3), "
        "mesh, strategy)\n"
        f"trainer = ns.Trainer(model, opt, {lname}, mesh=mesh, rules=strategy.rules,\n"
        f"                     microbatches={microbatches})\n"
        f"# trainer.fit(batches)  # batches: {request.get('batch_spec')}\n")
