"""ns.pack's token ids (every id it writes fits its int32 rows, and none is wrapped) and
its examples with their own masks (the assistant turns of transformers' chat template)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nnx_shard as ns
from nnx_shard._errors import UsageError


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
])
def test_pack_refuses_bad_masks_naming_the_example(examples: Any, kwargs: dict,
                                                   words: list[str]) -> None:
    with pytest.raises(UsageError, match="pack: ") as err:
        ns.pack(examples, 8, **kwargs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
