"""ns.pack's token ids: every id it writes fits its int32 rows, and none is wrapped."""

from __future__ import annotations

import numpy as np
import pytest

import nnx_shard as ns
from nnx_shard.errors import UsageError


@pytest.mark.parametrize(("examples", "words"), [
    ([[1, 2], [3, 2**40]], ["example 1", "1099511627776", "index 1", "int32"]),
    ([[5], np.array([7, 2**63], np.uint64)], ["example 1", "9223372036854775808", "index 1"]),
    ([np.array([2**64 - 1], np.uint64)], ["example 0", "18446744073709551615"]),
    ([[1, 2**70]], ["example 0", str(2**70)]),
    ([[4, -7, 5]], ["example 0", "-7", "index 1", "negative"]),
    ([[1], [2, 2**31]], ["example 1", str(2**31), "int32"]),
    ([np.array([3, -1], np.int8)], ["example 0", "-1", "negative"]),
])
def test_pack_refuses_ids_it_cannot_write(examples: list, words: list[str]) -> None:
    with pytest.raises(UsageError, match="pack: ") as err:
        ns.pack(examples, 8)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_pack_keeps_ids_up_to_int32s_largest() -> None:
    top = 2**31 - 1
    batch = ns.pack([np.array([0, top], np.uint64), np.array([top, 1], np.int64)], 4)
    assert batch["inputs"].dtype == np.int32
    assert batch["inputs"].tolist() == [[0, top, top, 1]]
    assert batch["targets"].tolist() == [[top, -100, 1, -100]]


@pytest.mark.parametrize("pad_id", [-1, 2**31, np.uint64(2**63)])
def test_pack_refuses_a_pad_id_it_cannot_write(pad_id: int) -> None:
    with pytest.raises(UsageError, match=rf"pack: pad_id {int(pad_id)} is not a token id"):
        ns.pack([[1, 2]], 4, pad_id=pad_id)
