"""nnx_shard._safetensors_io against the format's reference implementation (the
``safetensors`` package): each reads what the other writes, and every slice of a
tensor read with ranged reads equals numpy's slice of the whole tensor."""

from __future__ import annotations

import itertools
import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from nnx_shard import _safetensors_io as st
from nnx_shard._errors import NnxShardError

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int64, np.int8]


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {f"t{i}": (rng.normal(size=(3, 5, 4)) * 10).astype(d) for i, d in enumerate(DTYPES)}
    out["scalar"] = np.array(2.5, np.float32)
    out["row"] = np.arange(7, dtype=np.float32)
    return out


def test_reads_what_the_reference_writes(tmp_path) -> None:
    tensors = _tensors()
    path = str(tmp_path / "ref.safetensors")
    save_file({k: v for k, v in tensors.items() if v.dtype != ml_dtypes.bfloat16}, path,
              metadata={"format": "pt"})
    header = st.read_header(path)
    assert dict(header.metadata) == {"format": "pt"}
    for name, info in header.tensors.items():
        whole = tuple(slice(0, n) for n in info.shape)
        np.testing.assert_array_equal(st.read_slice(header, name, whole), tensors[name])
        assert st.read_slice(header, name, whole).dtype == tensors[name].dtype


def test_reference_reads_what_we_write(tmp_path) -> None:
    tensors = {k: v for k, v in _tensors().items() if v.dtype != ml_dtypes.bfloat16}
    path = str(tmp_path / "ours.safetensors")
    st.create(path, {k: (st.dtype_name(v.dtype), v.shape) for k, v in tensors.items()},
              {"format": "pt"})
    header = st.read_header(path)
    for name, v in tensors.items():
        st.write_slice(path, header, name, tuple(slice(0, n) for n in v.shape), v)
    back = load_file(path)
    assert set(back) == set(tensors)
    for name, v in tensors.items():
        np.testing.assert_array_equal(back[name], v)


def test_every_box_slice_reads_and_writes_exactly(tmp_path) -> None:
    x = np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5)
    path = str(tmp_path / "x.safetensors")
    st.create(path, {"pad": ("U8", (3,)), "x": ("F32", x.shape)})
    header = st.read_header(path)
    bounds = [[(0, 4), (1, 3), (3, 4)], [(0, 6), (2, 5), (0, 1)], [(0, 5), (1, 4), (4, 5)]]
    for box in itertools.product(*bounds):
        index = tuple(slice(a, b) for a, b in box)
        st.write_slice(path, header, "x", index, x[index])
    for box in itertools.product(*bounds):
        index = tuple(slice(a, b) for a, b in box)
        np.testing.assert_array_equal(st.read_slice(header, "x", index), x[index])
    np.testing.assert_array_equal(load_file(path)["x"], x)
    np.testing.assert_array_equal(load_file(path)["pad"], np.zeros(3, np.uint8))


def test_bfloat16_round_trip(tmp_path) -> None:
    x = (np.arange(12, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16).reshape(3, 4)
    path = str(tmp_path / "b.safetensors")
    st.create(path, {"b": ("BF16", (3, 4))})
    header = st.read_header(path)
    st.write_slice(path, header, "b", (slice(0, 3), slice(0, 4)), x)
    got = st.read_slice(header, "b", (slice(1, 3), slice(1, 3)))
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), x[1:3, 1:3].view(np.uint16))


def test_bad_files_are_named(tmp_path) -> None:
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"abc")
    with pytest.raises(ValueError, match="junk.safetensors: not a safetensors file"):
        st.read_header(str(junk))
    path = str(tmp_path / "cut.safetensors")
    st.create(path, {"x": ("F32", (100,))})
    os.truncate(path, os.path.getsize(path) - 8)
    with pytest.raises(ValueError, match=r"tensor 'x' ends at byte \d+ but the file has"):
        st.read_header(path)
    st.create(path, {"x": ("F32", (2,))})
    with pytest.raises(ValueError, match=r"takes float32\[2\], got float64\[2\]"):
        st.write_slice(path, st.read_header(path), "x", (slice(0, 2),), np.zeros(2))


# --------------------------------------------------------------------------- hostile headers


def _raw(path, header, data: bytes = b"", length: int | None = None) -> str:
    """A file with ``header`` (a JSON-able value, or the header's bytes as they are)
    and ``data``; ``length`` overrides the 8-byte header length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return str(path)


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# Headers that would load wrong weights if trusted: each is refused naming the tensor.
WRONG = {
    "negative_offset": ({"x": _entry("F32", [2], -4, 4)}, 8, "x",
                        r"data_offsets \[-4, 4\]"),
    "shared_bytes": ({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 0, 8)}, 8, "b",
                     "overlaps"),
    "f16_for_f32_bytes": ({"x": _entry("F16", [2], 0, 8)}, 8, "x",
                          r"F16 \[2\] takes 4 bytes but its data_offsets \[0, 8\] span 8"),
    "bf16_for_f32_bytes": ({"x": _entry("BF16", [4], 0, 16)}, 16, "x", "takes 8 bytes"),
    "f64_for_f32_bytes": ({"x": _entry("F64", [2], 0, 8)}, 8, "x", "takes 16 bytes"),
    "gap": ({"a": _entry("F32", [1], 0, 4), "b": _entry("F32", [1], 8, 12)}, 12, "b",
            r"starts at byte 8 of the data but the tensor before it \('a'\) ends at 4"),
    "not_from_zero": ({"a": _entry("F32", [1], 4, 8)}, 8, "a", "starts at byte 4"),
    "trailing_bytes": ({"a": _entry("F32", [1], 0, 4)}, 12, "a",
                       "8 bytes after the last tensor"),
    "inverted": ({"a": _entry("U8", [0], 4, 0)}, 4, "a", r"data_offsets \[4, 0\]"),
    "unknown_dtype": ({"a": _entry("F99", [1], 0, 4)}, 4, "a", "dtype 'F99'"),
    "bool_offset": ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]}}, 1, "a",
                    "data_offsets"),
    "float_shape": ({"a": _entry("F32", [2.0], 0, 8)}, 8, "a", r"shape \[2.0\]"),
    "negative_shape": ({"a": _entry("F32", [-1, -2], 0, 8)}, 8, "a", "shape"),
    "bool_shape": ({"a": _entry("U8", [True], 0, 1)}, 1, "a", "shape"),
    "str_shape": ({"a": _entry("U8", "1", 0, 1)}, 1, "a", "shape"),
    "entry_list": ({"a": [1, 2]}, 0, "a", "not an object"),
    "missing_dtype": ({"a": {"shape": [1], "data_offsets": [0, 4]}}, 4, "a", "dtype"),
    "missing_shape": ({"a": {"dtype": "F32", "data_offsets": [0, 4]}}, 4, "a", "shape"),
    "missing_offsets": ({"a": {"dtype": "F32", "shape": [1]}}, 4, "a", "data_offsets"),
    "three_offsets": ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}, 1, "a",
                      "data_offsets"),
    "metadata_list": ({"__metadata__": [1], "a": _entry("U8", [1], 0, 1)}, 1, "__metadata__",
                      "__metadata__"),
    "metadata_int_value": ({"__metadata__": {"format": 1}, "a": _entry("U8", [1], 0, 1)}, 1,
                           "__metadata__", "format"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_hostile_headers_are_refused_naming_file_and_tensor(tmp_path, case: str) -> None:
    header, size, name, match = WRONG[case]
    path = _raw(tmp_path / "bad.safetensors", header, bytes(size))
    with pytest.raises(NnxShardError, match=match) as info:
        st.read_header(path)
    text = str(info.value)
    assert path in text and repr(name) in text and "Fix:" in text, text
    assert len(text) < 2000


@pytest.mark.parametrize("header, length, match", [
    (b"[1, 2]", None, r"a list \(\[1, 2\]\), not a JSON object"),
    (b"5", None, r"an int \(5\), not a JSON object"),
    (b"\xff\xfe{}", None, "not UTF-8"),
    (b'{"a": 1', None, "not JSON"),
    (b"{}", 1 << 20, "header length 1048576 but the file has"),
    (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {"dtype": "U8", '
     b'"shape": [1], "data_offsets": [0, 1]}}', None, "names tensor 'a' twice"),
    (b'{"a": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, 1]}}', None, "NaN"),
])
def test_headers_that_are_not_header_objects(tmp_path, header: bytes, length, match) -> None:
    path = _raw(tmp_path / "odd.safetensors", header, b"\x00", length)
    with pytest.raises(NnxShardError, match=match) as info:
        st.read_header(path)
    assert path in str(info.value) and "Fix:" in str(info.value)


def test_what_writers_write_passes_the_checks(tmp_path) -> None:
    # Empty tensors and 0-d scalars take no / one element's bytes; the reference also
    # writes dtypes we cannot load into a model (U32, C64): their headers are valid.
    ours = str(tmp_path / "ours.safetensors")
    st.create(ours, {"e": ("F32", (0, 3)), "s": ("F16", ()), "z": ("BF16", (2, 0)),
                     "x": ("I8", (3,)), "e2": ("F32", (0,))}, {"format": "pt"})
    h = st.read_header(ours)
    assert {n: (t.shape, t.nbytes) for n, t in h.tensors.items()} == {
        "e": ((0, 3), 0), "s": ((), 2), "z": ((2, 0), 0), "x": ((3,), 3), "e2": ((0,), 0)}
    ref = str(tmp_path / "ref.safetensors")
    save_file({"e": np.zeros((0, 4), np.float32), "s": np.array(1.5, np.float64),
               "u": np.arange(3, dtype=np.uint32), "c": np.ones(2, np.complex64),
               "b": np.array([True, False])}, ref)
    h = st.read_header(ref)
    assert h.tensors["u"].dtype == "U32" and h.tensors["s"].shape == ()
    assert st.read_slice(h, "s", ()) == 1.5
    assert st.read_slice(h, "e", (slice(0, 0), slice(0, 4))).shape == (0, 4)


def test_names_in_two_files(tmp_path) -> None:
    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    st.create(a, {"w": ("F32", (1,))})
    st.create(b, {"w": ("F32", (1,))})
    with pytest.raises(NnxShardError, match=r"tensor 'w' is in two files: .*a.safetensors "
                       r"and .*b.safetensors"):
        st.read_header(a, b)
