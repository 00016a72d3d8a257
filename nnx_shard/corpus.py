"""A character-level text corpus that every machine has: the Python standard library's sources.

The demo needs real text with no download. Python ships its standard library as
source, so a fixed list of its modules, read in a fixed order, gives the same
corpus on every machine with the same Python version (about 1 MB). Training
text and held-out text come from different files, so the held-out loss measures
text the model has never seen. Characters are ASCII codes (vocabulary 128, a
power of two so it divides any mesh axis); the rare non-ASCII character becomes
``?``.

Nothing here imports jax: batches are NumPy, ready for ``nnx_shard.shard_batch``.

>>> from nnx_shard.corpus import VOCAB, decode, encode, load_stdlib
>>> corpus = load_stdlib()
>>> decode(encode("def f():")), VOCAB
('def f():', 128)
"""

from __future__ import annotations

import dataclasses
import math
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from nnx_shard._errors import UsageError

__all__ = ["VOCAB", "CharCorpus", "decode", "encode", "load_stdlib"]

VOCAB = 128

# Plain, long-lived modules present in every CPython >= 3.11; order matters (it
# fixes the corpus). Held-out files are never used for training.
TRAIN_FILES: tuple[str, ...] = (
    "argparse.py",
    "functools.py",
    "dataclasses.py",
    "collections/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "string.py",
    "shutil.py",
    "pathlib.py",
    "inspect.py",
    "typing.py",
    "enum.py",
    "heapq.py",
    "bisect.py",
    "fractions.py",
    "random.py",
    "statistics.py",
    "difflib.py",
    "csv.py",
    "configparser.py",
    "logging/__init__.py",
    "contextlib.py",
    "abc.py",
    "copy.py",
    "pprint.py",
)
HELDOUT_FILES: tuple[str, ...] = ("textwrap.py", "queue.py")

_UNKNOWN = ord("?")



def encode(text: str) -> np.ndarray:
    """Text -> ``uint8`` character codes in ``[0, 128)``; non-ASCII becomes ``?``.

    Args:
      text: the text.

    >>> from nnx_shard.corpus import decode, encode
    >>> encode("def f():").tolist()
    [100, 101, 102, 32, 102, 40, 41, 58]
    >>> decode(encode("naïve"))
    'na?ve'
    """
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return np.where(codes < VOCAB, codes, _UNKNOWN).astype(np.uint8)


def decode(tokens: Sequence[int] | np.ndarray) -> str:
    """Character codes -> text (the inverse of :func:`encode` on ASCII).

    Args:
      tokens: character codes (a sequence or an array).

    >>> from nnx_shard.corpus import decode
    >>> decode([104, 105])
    'hi'
    """
    return "".join(chr(int(t)) for t in np.asarray(tokens).reshape(-1))


@dataclasses.dataclass(frozen=True)
class CharCorpus:
    """Training and held-out character codes, with batch iterators and a baseline.

    Args:
      train: the training text's character codes.
      heldout: the held-out text's character codes.
      files: the training files' names.
      heldout_files: the held-out files' names.
      vocab: the number of codes (128: ASCII).

    >>> from nnx_shard.corpus import CharCorpus, encode
    >>> c = CharCorpus(encode("abcab" * 40), encode("abcab" * 8), files=("x",), heldout_files=("y",))
    >>> b = next(c.batches(batch=2, length=8, seed=0))
    >>> b["inputs"].shape, b["inputs"].dtype, bool((b["inputs"][:, 1:] == b["targets"][:, :-1]).all())
    ((2, 8), dtype('int32'), True)
    >>> round(c.unigram_baseline(), 3)   # nats per character
    1.535
    """

    train: np.ndarray
    heldout: np.ndarray
    files: tuple[str, ...]
    heldout_files: tuple[str, ...]
    vocab: int = VOCAB

    def batches(self, batch: int, length: int, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """An endless, seeded stream of random training windows.

        Each batch is ``{"inputs": int32[batch, length], "targets": int32[batch, length]}``
        with targets the inputs shifted by one character.
        """
        if len(self.train) <= length + 1:
            raise UsageError(f"batches: length={length}: the training text has {len(self.train)} "
                             f"characters; need > {length + 1}. Fix: a shorter length, or more text")
        rng = np.random.default_rng(seed)
        offsets = np.arange(length + 1)
        while True:
            starts = rng.integers(0, len(self.train) - length - 1, size=batch)
            windows = self.train[starts[:, None] + offsets].astype(np.int32)
            yield {"inputs": windows[:, :-1], "targets": windows[:, 1:]}

    def heldout_batches(self, batch: int, length: int, max_batches: int = 8) -> list[dict[str, np.ndarray]]:
        """Fixed, non-overlapping held-out windows (the same every call), at most ``max_batches``.

        >>> from nnx_shard.corpus import CharCorpus, encode
        >>> c = CharCorpus(encode("ab" * 50), encode("xy" * 50), files=(), heldout_files=())
        >>> [b["inputs"].shape for b in c.heldout_batches(batch=2, length=10)]
        [(2, 10), (2, 10), (2, 10), (2, 10)]
        """
        n = (len(self.heldout) - 1) // length
        n_batches = min(n // batch, max_batches)
        if n_batches == 0:
            raise UsageError(
                f"heldout_batches: batch={batch}, length={length}: the held-out text has "
                f"{len(self.heldout)} characters; need at least {batch * length + 1} for one "
                f"batch of {batch} x {length}. Fix: a smaller batch or length"
            )
        # Spread the windows over the whole held-out text, not just its start.
        stride = n // (n_batches * batch)
        starts = np.arange(n_batches * batch) * stride * length
        windows = self.heldout[starts[:, None] + np.arange(length + 1)].astype(np.int32)
        windows = windows.reshape(n_batches, batch, length + 1)
        return [{"inputs": w[:, :-1], "targets": w[:, 1:]} for w in windows]

    def unigram_baseline(self) -> float:
        """Cross-entropy (nats per character) of the held-out text under the training
        text's character frequencies (add-one smoothed): the loss of a model that
        ignores context. A language model must get below it to have learned anything."""
        counts = np.bincount(self.train, minlength=self.vocab).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-logp[self.heldout].mean())


def load_stdlib(root: str | Path | None = None) -> CharCorpus:
    """The corpus of :data:`TRAIN_FILES` and :data:`HELDOUT_FILES` from the running
    Python's standard library (or from ``root``). Files missing from an unusual
    installation are skipped; too little text left is an error.

    Args:
      root: the standard library's folder (default: the running Python's).

    >>> from nnx_shard.corpus import load_stdlib
    >>> corpus = load_stdlib()
    >>> len(corpus.train) > 500_000, len(corpus.heldout) > 10_000, corpus.vocab
    (True, True, 128)
    >>> 2.5 < corpus.unigram_baseline() < 4.0
    True
    """
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])

    def read(names: tuple[str, ...]) -> tuple[np.ndarray, tuple[str, ...]]:
        found = [n for n in names if (base / n).is_file()]
        text = "\n".join((base / n).read_text(encoding="utf-8", errors="replace") for n in found)
        return encode(text), tuple(found)

    train, files = read(TRAIN_FILES)
    heldout, heldout_files = read(HELDOUT_FILES)
    if len(train) < 100_000 or len(heldout) < 5_000:
        raise UsageError(
            f"load_stdlib: root: found only {len(train):,} training and {len(heldout):,} held-out "
            f"characters of Python sources under {str(base)!r}; the demo reads the standard "
            "library's .py files. Fix: pass root= the folder of a Python standard library's "
            "sources (a Python build without its sources has none)")
    return CharCorpus(train, heldout, files, heldout_files)


def bits(nats: float) -> float:
    """Nats -> bits.

    >>> round(bits(math.log(2)), 6)
    1.0
    """
    return nats / math.log(2)


