"""The demo corpus: ASCII codes in and out, train and held-out text from different files,
batches of the asked shape whose targets are the inputs shifted by one."""

from __future__ import annotations

import numpy as np
import pytest

import nnx_shard as ns


def test_encode_decode_round_trip_and_unknown_characters() -> None:
    ids = ns.corpus.encode("def f(x):\n    return x")
    assert ids.dtype.kind in "iu" and ids.max() < ns.corpus.VOCAB == 128
    assert ns.corpus.decode(ids) == "def f(x):\n    return x"
    assert ns.corpus.decode(ns.corpus.encode("é")) == "?"


def test_train_and_heldout_come_from_different_files() -> None:
    corpus = ns.corpus.load_stdlib()
    assert not set(corpus.files) & set(corpus.heldout_files)
    assert corpus.train.size > 100_000 and corpus.heldout.size > 10_000
    batch = next(corpus.batches(4, 32, seed=0))
    assert batch["inputs"].shape == batch["targets"].shape == (4, 32)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert 0 < corpus.unigram_baseline() < np.log(128)


def test_a_missing_root_is_refused() -> None:
    with pytest.raises(ns.UsageError, match="root: found only 0 training.*Fix: pass root="):
        ns.corpus.load_stdlib("/nowhere")
