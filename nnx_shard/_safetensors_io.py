"""The safetensors file format at the byte level: headers, and the byte ranges of
one slice of one tensor, read or written in place.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``name -> {"dtype", "shape", "data_offsets": [begin, end]}`` plus an optional
``"__metadata__"`` of strings) and the tensors' bytes, row-major, back to back.
A slice of a tensor (a box of index ranges) is a set of contiguous runs: one per
combination of indices of the dimensions before the last partial one. Reading
a slice reads exactly those runs with ``os.preadv`` into the destination
buffer, nothing else of the file; writing one ``pwrite``s them, so processes
holding different shards of a tensor can write them into one file at once.
Files a loader was pointed at are read through :func:`opened`: each opened once,
its header and every slice read from that one descriptor.
:mod:`nnx_shard.hf` builds sharded loading and saving on these.

>>> import os, tempfile
>>> import numpy as np
>>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
>>> x = np.arange(24, dtype=np.float32).reshape(4, 6)
>>> create(path, {"x": ("F32", (4, 6))})
>>> write_slice(path, read_header(path), "x", (slice(0, 4), slice(0, 6)), x)
>>> read_slice(read_header(path), "x", (slice(1, 3), slice(2, 4)))
array([[ 8.,  9.],
       [14., 15.]], dtype=float32)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from nnx_shard._errors import UsageError, short
from nnx_shard._trusted_files import open_within

__all__ = ["DTYPES", "Header", "TensorInfo", "create", "dtype_name", "opened", "read_bytes",
           "read_header", "read_slice", "sync", "write_file", "write_slice"]

#: safetensors dtype names and their numpy dtypes.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit
# Bits per element of every dtype the format defines (what its reference checks a
# header against); the ones not in DTYPES are valid in a file but do not load.
_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64,
}


def dtype_name(dtype: Any) -> str:
    """The safetensors name of a numpy/JAX dtype.

    >>> import jax.numpy as jnp
    >>> dtype_name(jnp.bfloat16), dtype_name(np.float32)
    ('BF16', 'F32')
    """
    d = np.dtype(dtype)
    for name, known in DTYPES.items():
        if known == d:
            return name
    raise UsageError(f"dtype: safetensors has no dtype for {d}; known: {', '.join(DTYPES)}. "
                     "Fix: cast to one of them, e.g. dtype=jnp.float32")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: its dtype name, shape and absolute byte offset."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Header:
    """The tensors of one or more safetensors files, by name."""

    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    #: The open file of each path that reads of the tensors' bytes come from (a header
    #: of :func:`opened`, while its block runs); a path not here is opened by name at
    #: each read.
    files: Mapping[str, BinaryIO] = dataclasses.field(default_factory=dict, compare=False,
                                                      repr=False)


_FIX_FILE = ("Fix: download or copy the file again, or re-save the checkpoint (its header "
             "does not describe its bytes as the safetensors format requires).")


def _bad(path: str, what: str, fix: str = _FIX_FILE) -> UsageError:
    return UsageError(f"{path}: not a safetensors file: {what}. {fix}")


def _no_duplicates(pairs: list[tuple[str, Any]], path: str) -> dict[str, Any]:
    # json keeps the last of two equal names: a tensor could hide behind another.
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _bad(path, f"its header names tensor {short(k, 100)} twice")
        out[k] = v
    return out


def _no_constant(path: str, name: str) -> Any:
    raise _bad(path, f"its header holds {name}, which is not JSON")


def _pread(fd: int, n: int, offset: int) -> bytes:
    """``n`` bytes at ``offset`` (fewer only at the end of the file); positional, so
    the file's own position (and another reader of the descriptor) is never moved."""
    parts, got = [], 0
    while got < n:
        part = os.pread(fd, n - got, offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _read_one(path: str, f: BinaryIO) -> tuple[dict[str, Any], int, int]:
    """The header of the file ``path``, open as ``f``, the absolute offset of its data
    and the data's size."""
    fd = f.fileno()
    size = os.fstat(fd).st_size
    raw = _pread(fd, 8, 0)
    if len(raw) != 8:
        raise _bad(path, f"it has {len(raw)} bytes, fewer than the 8 of its header length")
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER:
        raise _bad(path, f"header length {n} is over the format's limit of {_MAX_HEADER}")
    if 8 + n > size:
        raise _bad(path, f"header length {n} but the file has {size} bytes (truncated, or "
                   "not a safetensors file)")
    text = _pread(fd, n, 8)
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(path, f"its header is not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        header = json.loads(decoded, object_pairs_hook=lambda kv: _no_duplicates(kv, path),
                            parse_constant=lambda c: _no_constant(path, c))
    except json.JSONDecodeError as e:
        raise _bad(path, f"its header is not JSON ({e.msg} at character {e.pos})") from None
    except RecursionError:
        raise _bad(path, "its header is nested too deeply to be a safetensors header") from None
    if not isinstance(header, dict):
        raise _bad(path, f"its header is {described(header)}, not a JSON object of tensors")
    return header, 8 + n, size - 8 - n


def described(value: Any) -> str:
    """A value found in a file, for a message: its JSON kind and its (bounded) repr.

    >>> described([1, 2]), described(None)
    ('a list ([1, 2])', 'a null (None)')
    """
    kind = {list: "list", dict: "object", str: "string", bool: "bool", int: "int",
            float: "float", type(None): "null"}.get(type(value), type(value).__name__)
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({short(value, 60)})"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry(path: str, name: str, info: Any) -> tuple[str, tuple[int, ...], int, int]:
    """``(dtype, shape, begin, end)`` of one header entry, checked as the format
    requires: a known dtype, a shape of non-negative ints and offsets that span exactly
    the tensor's bytes."""
    where = f"tensor {short(name, 100)}"
    if not isinstance(info, dict):
        raise _bad(path, f"{where} is {described(info)}, not an object with dtype, shape and "
                   "data_offsets")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise _bad(path, f"{where} has no {' and no '.join(missing)}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _BITS:
        raise _bad(path, f"{where} has dtype {short(dtype, 60)}; the format's dtypes are "
                   f"{', '.join(_BITS)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _bad(path, f"{where} has shape {short(shape, 100)}; a shape is a list of "
                   "non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
            and 0 <= offsets[0] <= offsets[1]):
        raise _bad(path, f"{where} has data_offsets {short(offsets, 100)}; they are "
                   "[begin, end], two ints with 0 <= begin <= end")
    begin, end = offsets
    bits = math.prod(shape) * _BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        raise _bad(path, f"{where} of {dtype} {shape} takes {bits / 8:g} bytes but its "
                   f"data_offsets {offsets} span {end - begin}")
    return dtype, tuple(shape), begin, end


def _check_metadata(path: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(path, f"its '__metadata__' is {described(value)}, not an object of strings")
    bad = next((k for k, v in value.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise _bad(path, f"its '__metadata__' maps {short(bad, 60)} to "
                   f"{described(value[bad])}; metadata values are strings")
    return value


def _check_layout(path: str, spans: list[tuple[int, int, str]], start: int, data: int) -> None:
    """The tensors' bytes must tile the data section: sorted by offset, each starts
    where the one before it ends, the first at 0 and the last at the file's end (the
    format indexes every byte, so no byte is read as two tensors or as none)."""
    pos, before = 0, None
    for begin, end, name in sorted(spans):
        if begin != pos:
            was = (f"the tensor before it ({short(before, 100)}) ends at {pos}" if before
                   is not None else "the data starts at 0")
            how = "overlaps it" if begin < pos else f"leaves {begin - pos} bytes unindexed"
            raise _bad(path, f"tensor {short(name, 100)} starts at byte {begin} of the data "
                       f"but {was}: it {how}")
        pos, before = end, name
    if pos > data:
        raise _bad(path, f"tensor {short(before, 100)} ends at byte {start + pos} but the file "
                   f"has {start + data} bytes (truncated or partly copied)",
                   "Fix: copy the file again.")
    if pos < data:
        last = f"the last tensor ({short(before, 100)})" if before is not None else "the header"
        raise _bad(path, f"it has {data - pos} bytes after the last tensor: {last} ends at "
                   f"byte {pos} of {data} (two files joined, or the header is not this file's)")


def read_header(*paths: str) -> Header:
    """The tensors of the files ``paths`` (a name in two files is an error), after
    checking each file's header as the format requires: known dtypes, shapes of
    non-negative ints, every tensor's ``data_offsets`` spanning exactly its bytes,
    and the tensors together covering the data without gap or overlap. A header that
    is not one is a :class:`~nnx_shard._errors.UsageError` naming the file, the tensor,
    what was found and the fix. No tensor data is read.

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> create(path, {"w": ("BF16", (2, 3))}, {"format": "pt"})
    >>> h = read_header(path)
    >>> h.tensors["w"].shape, h.tensors["w"].nbytes, dict(h.metadata)
    ((2, 3), 12, {'format': 'pt'})
    >>> from pathlib import Path
    >>> f = Path(path)  # the same 12 bytes declared float32
    >>> _ = f.write_bytes(f.read_bytes().replace(b'"BF16"', b'"F32" '))
    >>> read_header(path)
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: ...: not a safetensors file: tensor 'w' of F32 [2, 3] takes 24 bytes but its data_offsets [0, 12] span 12. Fix: ...
    """
    with contextlib.ExitStack() as stack:
        files = {p: stack.enter_context(open(p, "rb")) for p in dict.fromkeys(paths)}
        return _parse(paths, files)


@contextlib.contextmanager
def opened(paths: Sequence[str], roots: Sequence[str]) -> Iterator[Header]:
    """:func:`read_header` of ``paths``, each file opened once
    (:func:`~nnx_shard._trusted_files.open_within` with ``roots``: a regular file, where
    a link leads only inside ``roots``) and kept open while the block runs: the header
    and every :func:`read_slice` of it come from that one descriptor, so a file
    replaced while it is read cannot put another file's bytes into the tensors.

    Raises what :func:`read_header` and :func:`~nnx_shard._trusted_files.open_within`
    raise.

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> path = os.path.join(folder, "o.safetensors")
    >>> create(path, {"o": ("I32", (3,))})
    >>> write_slice(path, read_header(path), "o", (slice(0, 3),), np.arange(3, dtype=np.int32))
    >>> with opened([path], [folder]) as h:
    ...     os.remove(path)  # the open file is still what is read
    ...     read_slice(h, "o", (slice(None),))
    array([0, 1, 2], dtype=int32)
    """
    with contextlib.ExitStack() as stack:
        files = {p: stack.enter_context(open_within(p, roots)) for p in dict.fromkeys(paths)}
        yield dataclasses.replace(_parse(paths, files), files=files)


def _parse(paths: Sequence[str], files: Mapping[str, BinaryIO]) -> Header:
    """The checked header of ``paths``, each read from its open file in ``files``."""
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for path in paths:
        header, start, data = _read_one(path, files[path])
        metadata.update(_check_metadata(path, header.pop("__metadata__", None)))
        spans = []
        for name, info in header.items():
            dtype, shape, begin, end = _entry(path, name, info)
            if name in tensors:
                raise UsageError(f"tensor {short(name, 100)} is in two files: "
                                 f"{tensors[name].path} and {path}. Fix: pass the files of "
                                 "one checkpoint (its index names each tensor's one file).")
            spans.append((begin, end, name))
            tensors[name] = TensorInfo(path, dtype, shape, start + begin, end - begin)
        _check_layout(path, spans, start, data)
    return Header(tensors, metadata)


def _runs(shape: Sequence[int], index: Sequence[slice], itemsize: int
          ) -> tuple[list[int], int, tuple[int, ...]]:
    """Byte offsets (relative to the tensor) of the contiguous runs of a box
    slice, the length of each run, and the slice's shape."""
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
    sub = tuple(b - a for a, b in bounds)
    ndim = len(shape)
    k = ndim - 1  # the last dimension not taken whole decides the run length
    while k > 0 and bounds[k] == (0, shape[k]):
        k -= 1
    strides = [itemsize * math.prod(shape[i + 1:]) for i in range(ndim)]
    if ndim == 0:
        return [0], itemsize, ()
    if math.prod(sub) == 0:
        return [], 0, sub
    run = (bounds[k][1] - bounds[k][0]) * strides[k]
    base = bounds[k][0] * strides[k]
    offsets = [base + sum(i * strides[d] for d, i in enumerate(combo))
               for combo in itertools.product(*(range(a, b) for a, b in bounds[:k]))]
    return offsets, run, sub


def read_slice(header: Header, name: str, index: Sequence[slice]) -> np.ndarray:
    """Reads ``tensor[index]`` (a box: one slice per dimension) from its file,
    touching only the bytes of the slice.

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "v.safetensors")
    >>> create(path, {"v": ("I32", (5,))})
    >>> write_slice(path, read_header(path), "v", (slice(0, 5),), np.arange(5, dtype=np.int32))
    >>> read_slice(read_header(path), "v", (slice(3, None),))
    array([3, 4], dtype=int32)
    """
    info = header.tensors[name]
    dtype = DTYPES[info.dtype]
    offsets, run, sub = _runs(info.shape, index, dtype.itemsize)
    out = np.empty(math.prod(sub) * dtype.itemsize, np.uint8)
    if offsets:
        f = header.files.get(info.path)
        fd = os.open(info.path, os.O_RDONLY) if f is None else f.fileno()
        try:
            view = memoryview(out.data)
            for i, off in enumerate(offsets):
                got = os.preadv(fd, [view[i * run:(i + 1) * run]], info.offset + off)
                if got != run:
                    raise OSError(f"{info.path}: short read of tensor {name!r}")
        finally:
            if f is None:
                os.close(fd)
    return out.view(dtype).reshape(sub)


def read_bytes(header: Header, name: str, start: int, n: int) -> bytes:
    """``n`` bytes of tensor ``name``'s data from its byte ``start`` on (fewer past its
    end), read as :func:`read_slice` reads.

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "b.safetensors")
    >>> create(path, {"b": ("U8", (4,))})
    >>> write_slice(path, read_header(path), "b", (slice(0, 4),), np.arange(4, dtype=np.uint8))
    >>> read_bytes(read_header(path), "b", 1, 2)
    b'\\x01\\x02'
    """
    info = header.tensors[name]
    n = max(0, min(n, info.nbytes - start))
    f = header.files.get(info.path)
    if f is not None:
        return _pread(f.fileno(), n, info.offset + start)
    with open(info.path, "rb") as g:
        return _pread(g.fileno(), n, info.offset + start)


def create(path: str, tensors: Mapping[str, tuple[str, Sequence[int]]],
           metadata: Mapping[str, str] | None = None) -> None:
    """Writes a safetensors file's header for ``tensors`` (name -> (dtype name,
    shape), stored in this order) and sizes the file; the data is written by
    :func:`write_slice`. The header is padded to 8 bytes, as the format's own
    writer does.

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "e.safetensors")
    >>> create(path, {"a": ("F32", (2,)), "b": ("F16", (3,))})
    >>> [(n, t.offset) for n, t in read_header(path).tensors.items()]
    [('a', 120), ('b', 128)]
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pos = 0
    for name, (dtype, shape) in tensors.items():
        n = DTYPES[dtype].itemsize * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_at(fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(fd, 8 + len(raw) + pos)
    finally:
        os.close(fd)


def _pwrite(fd: int, data: memoryview | bytes, offset: int) -> int:
    # Every byte this module writes goes through here (tests fail writes here).
    return os.pwrite(fd, data, offset)


def _write_at(fd: int, data: memoryview | bytes, offset: int) -> None:
    """All of ``data`` at ``offset`` (``pwrite`` may write less than asked)."""
    view = memoryview(data)
    while view:
        n = _pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_file(path: str, data: bytes) -> None:
    """Writes ``data`` as the whole file ``path`` and flushes it to disk.

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "c.json")
    >>> write_file(path, b"{}")
    >>> open(path).read()
    '{}'
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_at(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def sync(path: str) -> None:
    """Flushes the file ``path`` to disk (its data, before it is renamed into place).

    >>> import tempfile
    >>> sync(tempfile.mkstemp()[1])
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_slice(path: str, header: Header, name: str, index: Sequence[slice],
                data: np.ndarray) -> None:
    """Writes ``data`` into ``tensor[index]`` of the file at ``path`` in place
    (``pwrite``; other slices are untouched, so processes may write theirs
    concurrently). ``data`` must have the slice's shape and the tensor's dtype.

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> create(path, {"m": ("F32", (2, 2))})
    >>> h = read_header(path)
    >>> write_slice(path, h, "m", (slice(1, 2), slice(0, 2)), np.ones((1, 2), np.float32))
    >>> read_slice(h, "m", (slice(0, 2), slice(0, 2))).tolist()
    [[0.0, 0.0], [1.0, 1.0]]
    """
    info = header.tensors[name]
    dtype = DTYPES[info.dtype]
    offsets, run, sub = _runs(info.shape, index, dtype.itemsize)
    data = np.asarray(data, order="C")  # (ascontiguousarray makes a scalar 1-d)
    if data.shape != sub or data.dtype != dtype:
        # not user input: callers write the slices of the header they created; a mismatch is a bug
        raise ValueError(f"write_slice: tensor {name!r}{list(index)} takes {dtype}{list(sub)}, "
                         f"got {data.dtype}{list(data.shape)}")
    raw = memoryview(data.reshape(-1).view(np.uint8).data)
    fd = os.open(path, os.O_WRONLY)
    try:
        for i, off in enumerate(offsets):
            _write_at(fd, raw[i * run:(i + 1) * run], info.offset + off)
    finally:
        os.close(fd)
