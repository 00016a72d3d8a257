"""The one exception family of nnx_shard."""

from __future__ import annotations

import contextlib
import errno
import importlib
import importlib.util
import linecache
import os
import pathlib
import re
import reprlib
import stat
import traceback
from collections.abc import Iterator
from typing import Any

from nnx_shard import _compat


class NnxShardError(Exception):
    """The base of every error nnx_shard raises on purpose.

    Each says what is wrong with the input it was given, names the argument, and
    ends with a ``Fix:``; catching this class catches them all, and nothing else
    (a bug of ours, or of JAX, is not one of them). Which class is for what:

    - :class:`ShardingError` (a ``ValueError``): rules, annotations, meshes,
      shapes that a mesh does not divide, and JAX's sharding-type errors.
    - :class:`UsageError` (a ``ValueError``): any other bad input, a value of the
      wrong type included: arguments, names, sizes, files, batches, what a
      user's loss function returns, and the ``nnx-shard`` command's flags.
    - :class:`CompileError` (a ``RuntimeError``): a program compiled in a fresh
      Python failed or ran out of time.

    nnx_shard raises no bare ``ValueError`` or ``TypeError`` for bad input
    (``tests/test_errors.py`` pins it); the few left signal a bug of ours or
    follow a Python protocol.

    >>> from nnx_shard import CompileError, NnxShardError, ShardingError, UsageError
    >>> [c.__name__ for c in (ShardingError, UsageError, CompileError)
    ...  if issubclass(c, NnxShardError)]
    ['ShardingError', 'UsageError', 'CompileError']
    """


class ShardingError(NnxShardError, ValueError):
    """A sharding problem: bad rules, annotations, mesh or shapes.

    Messages name the parameter path, its shape, its logical names, the rule
    involved and a fix, so the error can be acted on without a debugger.

    >>> from nnx_shard import ShardingError
    >>> issubclass(ShardingError, ValueError)
    True
    """


class UsageError(NnxShardError, ValueError):
    """Bad input given by name or text: an unknown optimizer or model name, a size
    that is not one, a flag of the ``nnx-shard`` command. The command reports it
    as one ``nnx-shard: error: ...`` line with exit status 2.

    >>> from nnx_shard._units import parse_bytes
    >>> parse_bytes("lots")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: 'lots' is not a size. Fix: write e.g. 80GB, 80GiB or 512MiB
    """


class CompileError(NnxShardError, RuntimeError):
    """A program compiled (or measured) in a fresh Python with simulated devices
    failed or ran out of time; the message is one line and says what to change.

    >>> from nnx_shard import CompileError
    >>> issubclass(CompileError, RuntimeError)
    True
    """


class ShardingWarning(UserWarning):
    """A sharding choice the user allowed but should know about (e.g. a dimension
    replicated because it does not divide by its mesh axes)."""


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 80, 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8


def short(x: Any, limit: int = 200) -> str:
    """``repr(x)`` bounded for a message: nested containers and long strings are cut
    while the repr is built (a value from a hostile file can be huge), then the
    text is cut at ``limit`` characters.

    >>> short("x" * 1000)[:20], len(short("x" * 1000)) <= 200
    ("'xxxxxxxxxxxxxxxxxxx", True)
    >>> short([[1, 2, 3]] * 100)
    '[[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3], ...]'
    """
    if isinstance(x, str) and len(x) <= limit:
        text = repr(x)  # a path or a name: whole when it fits
    else:
        try:
            text = _REPR.repr(x)
        except Exception:  # a user's __repr__ failing must not hide the error being reported
            text = f"<{type(x).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def count(value: Any, name: str, *, least: int = 1, fix: str = "") -> int:
    """``value`` as an ``int`` when it is a whole count ``>= least``: an int or a NumPy
    integer, never a bool (``True`` is an int to Python, not a count), a float, None
    or text; otherwise a :class:`UsageError` naming ``name``.

    >>> count(4, "microbatches"), count(0, "num_steps", least=0)
    (4, 0)
    >>> count(True, "steps_per_call")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: steps_per_call must be a positive int, got True (a bool). Fix: e.g. steps_per_call=4
    """
    import numpy as np  # here: errors is imported by everything, numpy only by some

    kind = {1: "a positive int", 0: "a non-negative int"}.get(least, f"an int >= {least}")
    example = fix or f"e.g. {name.rpartition(' ')[2]}={max(least, 4)}"
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        what = " (a bool)" if isinstance(value, bool | np.bool_) else (
            "" if value is None else f" ({type(value).__name__})")
        raise UsageError(f"{name} must be {kind}, got {short(value, 60)}{what}. Fix: {example}")
    if value < least:
        raise UsageError(f"{name} must be {kind}, got {short(value, 60)}. Fix: {example}")
    return int(value)


def flag(value: Any, name: str) -> bool:
    """``value`` when it is a bool (or NumPy bool); anything else (``"no"``, ``None``,
    ``2``) is a :class:`UsageError` naming ``name``: a truthy string must not read as
    ``True``.

    >>> flag(False, "donate")
    False
    >>> flag("no", "donate")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: donate must be True or False, got 'no' (str). Fix: donate=True or donate=False
    """
    import numpy as np

    if not isinstance(value, bool | np.bool_):
        arg = name.rpartition(" ")[2]
        raise UsageError(f"{name} must be True or False, got {short(value, 60)} "
                         f"({type(value).__name__}). Fix: {arg}=True or {arg}=False")
    return bool(value)


def mode_kind(mode: int) -> str:
    """What a ``stat`` mode is, in a message's words.

    >>> import stat
    >>> mode_kind(stat.S_IFDIR), mode_kind(stat.S_IFREG), mode_kind(stat.S_IFIFO)
    ('a folder', 'a file', 'a FIFO')
    """
    return ("a folder" if stat.S_ISDIR(mode) else "a file" if stat.S_ISREG(mode)
            else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def path_kind(path: str | os.PathLike[str]) -> str | None:
    """What is at ``path`` (a link followed), in a message's words; ``None`` where
    nothing is.

    >>> path_kind("nnx_shard"), path_kind("pyproject.toml"), path_kind("no/such/path")
    ('a folder', 'a file', None)
    """
    try:
        return mode_kind(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):  # the latter: a parent is a file
        return "a symbolic link to nothing" if os.path.islink(path) else None
    except OSError as e:  # a loop of links, a name too long
        return f"a path that cannot be looked at ({e.strerror or e})"


def check_path(path: str | os.PathLike[str], who: str, *, want: str = "folder", fix: str,
               expected: str | None = None, name: str | None = None,
               missing_ok: bool = False, error: type[Exception] = FileNotFoundError,
               kind_error: type[Exception] | None = None) -> None:
    """Refuses ``path`` unless it is a ``want`` (``"folder"`` or ``"file"``) this
    process may read; ``missing_ok``: a folder that is created when missing, so only
    what is there is checked (the path, then the first of its parents that exists).

    The message starts with ``who``, names the path as ``name`` (default: the path),
    says what was ``expected`` (default ``"a folder"`` or ``"a file"``), what was
    found, and ends with ``Fix: {fix}``. A path that is missing or cannot be read
    raises ``error``, one of another kind ``kind_error`` (default ``error``), so
    that each caller keeps the type it documents.

    >>> check_path("nnx_shard", "load", fix="pass a checkpoint folder")
    >>> check_path("pyproject.toml", "load", fix="pass a checkpoint folder")
    Traceback (most recent call last):
    ...
    FileNotFoundError: load: pyproject.toml is a file, not a folder. Fix: pass a checkpoint folder
    >>> check_path("no/such", "load", want="file", expected="a config.json", fix="pass one")
    Traceback (most recent call last):
    ...
    FileNotFoundError: load: no/such is not a config.json (nothing is there). Fix: pass one
    """
    if want not in ("folder", "file"):
        # not user input: want is fixed by nnx_shard's own callers; another value is a bug
        raise ValueError(f"check_path: want must be 'folder' or 'file', got {want!r}")
    expected = expected or f"a {want}"
    name = name or os.fspath(path)
    wrong = kind_error or error
    right = "a folder" if want == "folder" else "a file"
    kind = path_kind(path)
    if kind is None:
        if not missing_ok:
            raise error(f"{who}: {name} is not {expected} (nothing is there). Fix: {fix}")
        # Created when missing: the first parent that exists must be a folder.
        for parent in pathlib.Path(os.path.abspath(path)).parents:
            above = path_kind(parent)
            if above is None:
                continue
            if above != "a folder":
                raise wrong(f"{who}: {name} is under {parent}, which is {above}, not "
                            f"{expected}. Fix: {fix}")
            return
        return
    if kind != right:
        raise wrong(f"{who}: {name} is {kind}, not {expected}. Fix: {fix}")
    if not missing_ok and not os.access(path, os.R_OK | (os.X_OK if want == "folder" else 0)):
        raise error(f"{who}: {name} is {kind} this process may not read. Fix: give it read "
                    f"permission, or {fix}")


class LinkedOut(UsageError):
    """A file that leads out of the folder it must be read from: a symbolic link out
    of it, or a link swapped in while the file was being opened. ``path`` is the file
    as it was named, ``target`` where it led; callers say what that means to them.

    >>> LinkedOut("/ckpt/tokenizer.json", "/etc/hostname").target
    '/etc/hostname'
    """

    def __init__(self, path: str, target: str) -> None:
        super().__init__(f"{path} leads to {target}, outside the folder it is read from. "
                         "Fix: put a copy of the file in the folder instead of a link out.")
        self.path, self.target = path, target

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.target)


class NotAFile(NnxShardError, OSError):
    """What is at a path that must be a regular file is something else (a folder, a
    FIFO, a device); ``kind`` says what, as :func:`mode_kind` words it.

    >>> NotAFile("/ckpt/tokenizer.json", "a FIFO").strerror
    'a FIFO, not a regular file'
    """

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"{kind}, not a regular file", path)
        self.kind = kind

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.filename, self.kind)


def raise_collected(errors: list[str], what: str = "variables") -> None:
    """Raises one ShardingError for every problem found in a pass over a tree, so a
    single run shows every parameter that needs a fix (no-op when ``errors`` is empty)."""
    if len(errors) == 1:
        raise ShardingError(errors[0])
    if errors:
        raise ShardingError(
            f"{len(errors)} {what} cannot be sharded:\n" + "\n".join(f"- {e}" for e in errors)
        )


# JAX exports no public name for the errors its sharding-in-types rules raise on Explicit
# mesh axes; nnx_shard/_compat.py reads both (tests/test_compat.py pins them).
ShardingTypeError = _compat.ShardingTypeError
DuplicateSpecError = _compat.DuplicateSpecError

# JAX's error text, read as of jax 0.10.2 to 0.12 (it has no structured field for these; see
# docs/architecture.md, "Where the library touches process state"). The patterns only
# pick words for our message: text they do not match is still quoted whole.
# A JAX TypeError that is about sharding types: scan's carry changed its sharding.
_CARRY_MISMATCH = "carry input and carry output must have equal types"
# Array types as JAX prints them: float32[8@data,16] (dims, @ the mesh axes sharding them).
_TYPED = re.compile(r"\b(?:bool|[a-z]+[0-9]+)\[[^\[\]]*\]")
_OPERATION = (
    re.compile(r"^(\w+) operation with inputs"),
    re.compile(r"for the (\w+) (?:indexing|operation)"),
    re.compile(r"^(\w+) got incompatible shardings"),
    re.compile(r"`(\w+)` operation"),
    re.compile(r"^(scan) body function carry"),
)
# Messages that do not name their operation.
_UNNAMED = (("Contracting dimensions are sharded", "dot_general"),)
# JAX's own functions that name the operation a message does not (innermost first).
_JAX_OPS = re.compile(r"(gather|scatter|dot_general|einsum|reshape|concatenate|broadcast|"
                      r"dynamic_slice|dynamic_update_slice|take|transpose)")


def _package_dirs(*names: str) -> tuple[str, ...]:
    # Where the installed packages live, so frames are told apart by location, not by a
    # substring that a user's own checkout (e.g. ~/nnx_shard/examples) would also match.
    dirs = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            dirs.append(os.path.dirname(os.path.abspath(spec.origin)) + os.sep)
    return tuple(dirs)


_JAX_DIRS = _package_dirs("jax", "jaxlib")
_LIBRARY_DIRS = (*_JAX_DIRS, *_package_dirs("flax", "optax", "nnx_shard"))


def is_sharding_type_error(e: BaseException) -> bool:
    """``e`` is JAX rejecting an operation's sharding types (Explicit mesh axes).

    >>> is_sharding_type_error(ShardingTypeError("...")), is_sharding_type_error(TypeError("x"))
    (True, False)
    """
    if isinstance(e, ShardingTypeError | DuplicateSpecError):
        return True
    return isinstance(e, TypeError) and _CARRY_MISMATCH in str(e) and "@" in str(e)


def _frame_text(frame: Any, lineno: int) -> str:
    code = frame.f_code
    owner = frame.f_locals.get("self")
    func = f"{type(owner).__name__}.{code.co_name}" if owner is not None else code.co_name
    line = linecache.getline(code.co_filename, lineno).strip()
    path = code.co_filename.rpartition(f"site-packages{os.sep}")[2]
    where = f"{func} ({path}:{lineno})"
    return f"{where}: {line}" if line else where


def sharding_type_error(entry: str, e: BaseException) -> ShardingError:
    """The ShardingError for a JAX sharding-type error ``e`` raised inside ``entry``:
    it names the operation, the arrays (with their sharding, as JAX typed them),
    where in the model it happened, and the fix.

    >>> e = ShardingTypeError("dot_general operation with inputs: f32[8@data,32], "
    ...                       "f32[32,16@data] produces an illegally sharded result: ...")
    >>> print(sharding_type_error("multistep(step)(...)", e))
    multistep(step)(...): JAX rejected the sharding types of a 'dot_general' operation on Explicit mesh axes. Arrays involved (dims@mesh axes): f32[8@data,32], f32[32,16@data]. JAX says: ... Fix: build the mesh with Auto axes, ns.make_mesh(..., axis_types='auto') ...
    """
    msg = str(e).strip() or type(e).__name__
    op = next((m.group(1) for rx in _OPERATION if (m := rx.search(msg))), None)
    op = op or next((name for text, name in _UNNAMED if text in msg), None)
    frames = list(traceback.walk_tb(e.__traceback__))
    if op is None:
        names = [f.f_code.co_name for f, _ in reversed(frames)
                 if f.f_code.co_filename.startswith(_JAX_DIRS)]
        op = next((m.group(1) for n in names if (m := _JAX_OPS.search(n))), None)
    outside_jax = [(f, n) for f, n in frames if not f.f_code.co_filename.startswith(_JAX_DIRS)]
    user = [(f, n) for f, n in frames if not f.f_code.co_filename.startswith(_LIBRARY_DIRS)]
    parts = [f"{entry}: JAX rejected the sharding types of "
             + (f"a {op!r} operation" if op else "an operation")
             + " on Explicit mesh axes"]
    if outside_jax:
        parts.append(f", in {_frame_text(*outside_jax[-1])}")
    if user and (not outside_jax or user[-1][0] is not outside_jax[-1][0]):
        parts.append(f" (called from {_frame_text(*user[-1])})")
    arrays = list(dict.fromkeys(_TYPED.findall(msg)))
    if arrays:
        parts.append(f". Arrays involved (dims@mesh axes): {', '.join(arrays)}")
    said = " ".join(msg.split()) if _CARRY_MISMATCH in msg else msg
    said = said if len(said) < 800 else said[:800] + "..."
    parts.append(f". JAX says: {said.rstrip('.')}")
    parts.append(
        ". On Explicit axes every operation must have one unambiguous output sharding, "
        "which stock Flax layers do not give. Fix: build the mesh with Auto axes, "
        "ns.make_mesh(..., axis_types='auto') (the default of ns.make_mesh and "
        "Strategy.make_mesh), so XLA propagates the layouts; or keep Explicit axes and "
        "give that operation an out_sharding (e.g. x.at[i].get(out_sharding=P(...)), "
        "jnp.einsum(..., out_sharding=P(...)), or jax.sharding.reshard before a scan "
        "carry is returned)."
    )
    return ShardingError("".join(parts))


@contextlib.contextmanager
def sharding_types(entry: str) -> Iterator[None]:
    """JAX's sharding-type errors (Explicit mesh axes) raised inside leave as the
    ShardingError of :func:`sharding_type_error` for ``entry``.

    >>> with sharding_types("f(...)"):
    ...     raise ShardingTypeError("dot_general operation with inputs: f32[8@data]")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.ShardingError: f(...): JAX rejected the sharding types of a 'dot_general' ...
    """
    try:
        yield
    except Exception as e:
        if is_sharding_type_error(e):
            raise sharding_type_error(entry, e) from e
        raise
