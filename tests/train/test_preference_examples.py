"""The preference set shipped with the package (``preference.example_pairs``); the
preference guide (docs/guides/preference.md, run by the slow tier) trains on it."""

import pytest

from nnx_shard import UsageError, preference


def _texts(pairs):
    return [(p["prompt"][0]["content"], p["chosen"][0]["content"], p["rejected"][0]["content"])
            for p in pairs]


def test_the_shipped_pairs_are_trls_format_and_the_heldout_questions_are_new():
    train, heldout = preference.example_pairs(), preference.example_pairs("heldout")
    assert (len(train), len(heldout)) == (40, 8)
    for pair in train + heldout:
        assert [m["role"] for m in pair["prompt"]] == ["user"]
        assert [m["role"] for m in pair["chosen"]] == [m["role"] for m in pair["rejected"]] \
            == ["assistant"]
    questions = [t[0] for t in _texts(train)]
    assert len(set(questions)) == 40
    assert not set(questions) & {t[0] for t in _texts(heldout)}
    assert all(c != r for _, c, r in _texts(train + heldout))
    text = preference.example_pairs("train", chat=False)
    assert text[1] == {"prompt": "Question: What is the capital of France?\nAnswer:",
                       "chosen": " Paris.",
                       "rejected": " Well, I think it might be Lyon, but I am not sure."}
    # each call returns a new list: a caller's edits do not leak into the next
    train[0]["prompt"][0]["content"] = "edited"
    assert preference.example_pairs()[0]["prompt"][0]["content"] == "What is 2 + 2?"


def test_an_unknown_split_names_the_splits():
    with pytest.raises(UsageError, match=r"split='test' is not one of \('train', 'heldout'\)"):
        preference.example_pairs("test")
