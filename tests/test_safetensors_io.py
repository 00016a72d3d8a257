"""nnx_shard.safetensors_io against the format's reference implementation (the
``safetensors`` package): each reads what the other writes, and every slice of a
tensor read with ranged reads equals numpy's slice of the whole tensor."""

from __future__ import annotations

import itertools
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from nnx_shard import safetensors_io as st

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
