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

import dataclasses
import itertools
import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["DTYPES", "Header", "TensorInfo", "create", "dtype_name", "read_header",
           "read_slice", "sync", "write_file", "write_slice"]

#: safetensors dtype names and their numpy dtypes.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


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
    raise ValueError(f"safetensors has no dtype for {d}; known: {', '.join(DTYPES)}")


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


def _read_one(path: str) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header "
                             "length).")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ValueError(f"{path}: not a safetensors file (header length {n}).")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: not a safetensors file (header is not JSON: {e}).") \
                from None
    return header, 8 + n


def read_header(*paths: str) -> Header:
    """The tensors of the files ``paths`` (a name in two files is an error),
    after checking that every tensor lies inside its file.

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> create(path, {"w": ("BF16", (2, 3))}, {"format": "pt"})
    >>> h = read_header(path)
    >>> h.tensors["w"].shape, h.tensors["w"].nbytes, dict(h.metadata)
    ((2, 3), 12, {'format': 'pt'})
    """
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for path in paths:
        header, start = _read_one(path)
        size = os.path.getsize(path)
        for name, info in header.items():
            if name == "__metadata__":
                metadata.update(info or {})
                continue
            if name in tensors:
                raise ValueError(f"tensor {name!r} is in two files: {tensors[name].path} and "
                                 f"{path}.")
            begin, end = info["data_offsets"]
            if start + end > size:
                raise ValueError(
                    f"{path}: tensor {name!r} ends at byte {start + end} but the file has "
                    f"{size} bytes (truncated or partly copied). Fix: copy the file again."
                )
            tensors[name] = TensorInfo(path, info["dtype"], tuple(info["shape"]), start + begin,
                                       end - begin)
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
        fd = os.open(info.path, os.O_RDONLY)
        try:
            view = memoryview(out.data)
            for i, off in enumerate(offsets):
                got = os.preadv(fd, [view[i * run:(i + 1) * run]], info.offset + off)
                if got != run:
                    raise OSError(f"{info.path}: short read of tensor {name!r}")
        finally:
            os.close(fd)
    return out.view(dtype).reshape(sub)


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
        raise ValueError(f"write_slice: tensor {name!r}{list(index)} takes {dtype}{list(sub)}, "
                         f"got {data.dtype}{list(data.shape)}")
    raw = memoryview(data.reshape(-1).view(np.uint8).data)
    fd = os.open(path, os.O_WRONLY)
    try:
        for i, off in enumerate(offsets):
            _write_at(fd, raw[i * run:(i + 1) * run], info.offset + off)
    finally:
        os.close(fd)
