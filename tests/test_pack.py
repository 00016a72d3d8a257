"""ns.pack's token ids (every id it writes fits its int32 rows, and none is wrapped),
its examples with their own masks (the assistant turns of transformers' chat template),
its placement (first fit decreasing, in n log n) and the rows it allocates."""

from __future__ import annotations

import json
import math
import random
import tracemalloc
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import nnx_shard as ns
from nnx_shard._errors import UsageError
from nnx_shard._pack import _check_bytes, _first_fit


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


# -- examples with their own masks (multi-turn conversations) ---------------------------

CHAT_MASKS = json.loads((Path(__file__).parent / "fixtures/chat_masks/expected.json")
                        .read_text())["cases"]


def _shifted(ids: list[int], mask: list[int]) -> list[int]:
    """transformers' labels (the ids where the mask is 1), shifted as its loss shifts them."""
    return [t if m else -100 for t, m in zip(ids[1:], mask[1:], strict=True)] + [-100]


@pytest.mark.parametrize("template", ["chat_masks/chatml.jinja", "chat_masks/llama3.jinja"])
def test_pack_takes_the_masks_of_transformers_chat_template(template: str) -> None:
    cases = [c for c in CHAT_MASKS if c["template"] == template]
    examples = [{"input_ids": c["input_ids"], "assistant_masks": c["assistant_masks"],
                 "attention_mask": [1] * len(c["input_ids"])} for c in cases]
    batch = ns.pack(examples, 256)
    seen = 0
    for r, (row, seg, targets) in enumerate(zip(batch["inputs"], batch["segment_ids"],
                                                batch["targets"], strict=True)):
        for s in range(1, int(seg.max()) + 1):
            at = np.flatnonzero(seg == s)
            ids = row[at].tolist()
            case = next(c for c in cases if c["input_ids"] == ids)
            assert targets[at].tolist() == _shifted(ids, case["assistant_masks"]), (r, s)
            seen += 1
        assert (targets[seg == 0] == -100).all()
    assert seen == len(cases)
    kept = sum(sum(c["assistant_masks"][1:]) for c in cases)
    assert int((batch["targets"] != -100).sum()) == kept > 0


def test_pack_masks_as_dicts_tuples_arrays_and_bools_agree() -> None:
    ids, mask = [5, 6, 7, 8, 9, 10], [0, 1, 1, 0, 0, 1]
    want = ns.pack([{"input_ids": ids, "assistant_masks": mask}, [1, 2]], 8)
    assert want["targets"].tolist() == [[6, 7, -100, -100, 10, -100, 2, -100]]
    for example in ((ids, mask), (np.array(ids), np.array(mask, bool)),
                    {"input_ids": np.array(ids, np.int32), "assistant_masks": tuple(mask)},
                    (ids, [bool(m) for m in mask])):
        got = ns.pack([example, [1, 2]], 8)
        for key in want:
            assert got[key].tolist() == want[key].tolist(), (example, key)
    # a mask of 0s on the prompt does what prompt_lengths does
    prompt = ns.pack([[1, 2, 3, 4], [5, 6, 7]], 8, prompt_lengths=[2, 1])
    masked = ns.pack([([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6, 7], [0, 1, 1])], 8)
    for key in prompt:
        assert masked[key].tolist() == prompt[key].tolist()
    # a dict without a mask trains on every token, as a list does; mixed with masked ones
    plain = ns.pack([{"input_ids": [3, 4, 5]}, ([6, 7, 8], [1, 1, 0])], 6)
    assert plain["targets"].tolist() == [[4, 5, -100, 7, -100, -100]]
    # a tuple of ints is still a list of ids
    assert ns.pack([(3, 4)], 2)["targets"].tolist() == [[4, -100]]


@pytest.mark.parametrize(("examples", "kwargs", "words"), [
    ([[1, 2], ([1, 2, 3], [0, 1])], {}, ["example 1's mask", "2 values", "3 tokens"]),
    ([{"input_ids": [1, 2], "assistant_masks": [0, 1, 1]}], {},
     ["example 0's assistant_masks", "3 values", "2 tokens"]),
    ([([1, 2, 3], [0, 2, 1])], {}, ["example 0's mask", "holds 2 at index 1", "0 or 1"]),
    ([{"input_ids": [1, 2], "assistant_masks": [-100, 2]}], {},
     ["example 0's assistant_masks", "-100", "labels"]),
    ([([1, 2], [0.0, 1.0])], {}, ["example 0's mask", "0s and 1s"]),
    ([([1, 2], "01")], {}, ["example 0's mask", "0s and 1s"]),
    ([([1, 2], [[0, 1]])], {}, ["example 0's mask", "0s and 1s"]),
    ([[1], ([1, 2], [0, 1])], {"prompt_lengths": [0, 1]},
     ["example 1", "prompt_lengths", "one or the other"]),
    ([{"input_ids": [1, 2], "labels": [-100, 2]}], {}, ["example 0", "'labels'", "-100"]),
    ([{"input_ids": [1, 2], "assistant_mask": [0, 1]}], {}, ["example 0", "'assistant_mask'"]),
    ([[1], {"assistant_masks": [0, 1]}], {}, ["example 1", "without 'input_ids'"]),
    ([{"input_ids": [1, 2, 0], "attention_mask": [1, 1, 0]}], {},
     ["example 0's attention_mask", "pads the rows itself"]),
    ([{"input_ids": [], "assistant_masks": []}], {}, ["example 0", "non-empty"]),
    ([[[1, 2], [0, 1]]], {}, ["example 0", "tuple (ids, mask)"]),
    ({"input_ids": [1, 2], "assistant_masks": [0, 1]}, {}, ["examples", "put it in a list"]),
    ([[1], {"input_ids": [1, 2], "assistant_masks": None}], {},
     ["example 1's assistant_masks is None", "every token", "drop the key"]),
    ([([1, 2], None)], {}, ["example 0's mask (the tuple's second item) is None",
                            "pass the ids alone"]),
])
def test_pack_refuses_bad_masks_naming_the_example(examples: Any, kwargs: dict,
                                                   words: list[str]) -> None:
    with pytest.raises(UsageError, match="pack: ") as err:
        ns.pack(examples, 8, **kwargs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


# -- placement and allocation --------------------------------------------------------------


def _pack_by_scan(examples: list[list[int]], length: int) -> dict[str, list[list[int]]]:
    """First fit decreasing by scanning every row, one example at a time: what pack's
    tree must place alike."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(examples)), key=lambda j: -len(examples[j])):
        row = next((r for r, free in enumerate(room) if free >= len(examples[i])), None)
        if row is None:
            rows.append([])
            room.append(length)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= len(examples[i])
    out: dict[str, list[list[int]]] = {k: [] for k in
                                       ("inputs", "targets", "segment_ids", "positions")}
    for members in rows:
        line = [examples[i] for i in members]
        pad = length - sum(map(len, line))
        out["inputs"].append([t for ex in line for t in ex] + [0] * pad)
        out["targets"].append([t for ex in line for t in [*ex[1:], -100]] + [-100] * pad)
        out["segment_ids"].append([s for s, ex in enumerate(line, 1) for _ in ex] + [0] * pad)
        out["positions"].append([k for ex in line for k in range(len(ex))] + [0] * pad)
    return out


@pytest.mark.parametrize(("seed", "count", "longest", "length"),
                         [(0, 300, 8, 8), (1, 500, 30, 64), (2, 200, 100, 100), (3, 1, 5, 7)])
def test_pack_places_each_example_in_the_first_row_with_room(seed: int, count: int,
                                                             longest: int, length: int) -> None:
    rng = random.Random(seed)
    examples = [[rng.randrange(1, 1000) for _ in range(rng.randrange(1, longest + 1))]
                for _ in range(count)]
    got = {k: v.tolist() for k, v in ns.pack(examples, length).items()}
    assert got == _pack_by_scan(examples, length)


class _Counted(int):
    """An example's size that counts the comparisons made with it, and stops the call
    once they pass ``budget`` (a scan of every row would run for hours, not fail)."""

    seen: ClassVar[list[int]] = [0]
    budget: ClassVar[list[int]] = [0]

    def _count(self) -> None:
        self.seen[0] += 1
        if self.seen[0] > self.budget[0]:
            raise AssertionError(f"more than {self.budget[0]:,} comparisons of sizes")

    def __lt__(self, other: object) -> bool:
        self._count()
        return int(self) < other  # type: ignore[operator]

    def __le__(self, other: object) -> bool:
        self._count()
        return int(self) <= other  # type: ignore[operator]

    def __gt__(self, other: object) -> bool:
        self._count()
        return int(self) > other  # type: ignore[operator]

    def __ge__(self, other: object) -> bool:
        self._count()
        return int(self) >= other  # type: ignore[operator]


@pytest.mark.parametrize(("size", "length"), [(8, 8), (3, 8), (1, 2048)])
def test_pack_finds_each_row_in_log_n_comparisons(size: int, length: int) -> None:
    # One example per row (8 in 8) is a scan's worst case: 5e9 comparisons for 100,000
    # examples. The tree compares each size once per level: 17 levels for 100,000 rows.
    n = 100_000
    _Counted.seen[0], _Counted.budget[0] = 0, n * math.ceil(math.log2(n) + 1)
    rows, at, segments, used = _first_fit([_Counted(size)] * n, length)
    assert 0 < _Counted.seen[0] <= _Counted.budget[0]
    per_row = length // size
    assert used == -(-n // per_row)
    assert rows[:per_row + 1] == [0] * per_row + [1 if per_row < n else 0]
    assert at[per_row - 1] == (per_row - 1) * size and segments[per_row - 1] == per_row


def test_pack_takes_100k_examples() -> None:
    full = [[1 + k % 5] * 8 for k in range(100_000)]
    batch = ns.pack(full, 8)
    assert batch["inputs"].shape == (100_000, 8)
    assert batch["segment_ids"].max() == 1 and batch["inputs"][-1].tolist() == [5] * 8
    assert batch["targets"][0].tolist() == [1] * 7 + [-100]


@pytest.mark.parametrize("length", [2**31, 2**40])
def test_pack_refuses_a_length_int32_positions_cannot_count(length: int) -> None:
    with pytest.raises(UsageError, match=rf"pack: length {length} .* int32 positions"):
        ns.pack([[1, 2]], length)


def test_pack_refuses_rows_of_mostly_padding_before_allocating() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(UsageError) as err:
            ns.pack([[1, 2]], 2**31 - 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2**20   # nothing of the 32 GiB was allocated
    for words in ("pack: length 2147483647", "1 row(s)", "2 tokens", "32.0 GiB", "at most 1 GiB"):
        assert words in str(err.value)
    # A long row the examples leave mostly empty is fine while its padding is small.
    assert ns.pack([[1, 2]], 2**20)["inputs"].shape == (1, 2**20)
    # So are many rows whose padding, however large, stays under their tokens: 2 million
    # examples of 1025 tokens, one to a row of 2048, pad 31 GiB of rows.
    _check_bytes(2_000_000, 2048, 2_000_000 * 1025)
    with pytest.raises(UsageError, match="488.3 GiB of arrays, 488.3 GiB of it padding"):
        _check_bytes(2_000_000 // 64, 2**20, 2_000_000)
    _check_bytes(2, 2**26 - 1, 2**26)   # 2 GiB of rows, under half of them padding
