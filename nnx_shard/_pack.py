"""Variable-length examples packed into fixed-length rows for training: :func:`pack`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

from nnx_shard._errors import UsageError, short

__all__ = ["IGNORE_INDEX", "pack"]

#: The target :func:`pack` writes where nothing is to be predicted, the one
#: :func:`nnx_shard.models.lm_loss` skips (transformers' ``ignore_index``).
IGNORE_INDEX = -100


#: The largest token id :func:`pack` can write: its rows are int32.
_ID_MAX = int(np.iinfo(np.int32).max)


def _check_ids(i: int, ids: np.ndarray | list[int]) -> None:
    """Example ``i``'s token ids are 0 .. int32's largest: a negative id or one that
    int32 cannot hold must not be wrapped (2**40 and 2**63 would both become 0)."""
    if isinstance(ids, np.ndarray):
        # Compared in the ids' own dtype (uint64 2**63 is no negative int64 here).
        if not ids.size or (ids.min() >= 0 and ids.max() <= _ID_MAX):
            return
        at = int(np.flatnonzero((ids < 0) | (ids > _ID_MAX))[0])
        value = int(ids[at])
    else:
        bad = next(((j, t) for j, t in enumerate(ids) if not 0 <= t <= _ID_MAX), None)
        if bad is None:
            return
        at, value = bad
    why = "negative" if value < 0 else f"more than int32 holds ({_ID_MAX})"
    raise UsageError(f"pack: example {i} has token id {value} at index {at}, {why}. Token ids "
                     f"are 0 .. {_ID_MAX} (the vocabulary's; rows are int32). Fix: map the "
                     "example through the tokenizer's vocabulary, and mark tokens not to learn "
                     "with prompt_lengths or a mask, not with negative ids.")


#: The keys a dict example may have: ``apply_chat_template(..., return_dict=True,
#: return_assistant_tokens_mask=True)``'s.
_KEYS = ("input_ids", "assistant_masks", "attention_mask")
_MASKED = ("an example with its own mask is a dict {'input_ids': ids, 'assistant_masks': mask} "
           "or a tuple (ids, mask)")


def _array(value: Any) -> np.ndarray:
    """``value`` as an array; text, a dict or a ragged list as a 0-d ``None``
    (refused by the caller, naming the example)."""
    if type(value) is not list and isinstance(value, str | bytes | Mapping):
        return np.asarray(None)
    try:
        return np.asarray(value)
    except (ValueError, TypeError):  # ragged nesting
        return np.asarray(None)


def _is_row(value: Any) -> bool:
    """Whether ``value`` is a list of values (not one value, not text)."""
    if isinstance(value, np.ndarray):
        return value.ndim >= 1
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _split(i: int, ex: Any) -> tuple[Any, Any, str]:
    """Example ``i`` as ``(ids, mask or None, what names the mask)``."""
    if isinstance(ex, Mapping):
        unknown = [k for k in ex if k not in _KEYS]
        if unknown:
            hint = (" Fix: a mask of the tokens to learn, e.g. assistant_masks=[int(t != -100) "
                    "for t in labels]." if "labels" in unknown else
                    f" Fix: keep only {', '.join(_KEYS)}.")
            raise UsageError(f"pack: example {i} has the key {short(unknown[0], 40)}; a dict "
                             f"example has 'input_ids' and may have 'assistant_masks' (1: "
                             f"learn the token) and 'attention_mask' (all 1).{hint}")
        if "input_ids" not in ex:
            raise UsageError(f"pack: example {i} is a dict without 'input_ids' (keys: "
                             f"{short(list(ex), 60)}). Fix: {_MASKED}, as "
                             "tok.apply_chat_template(messages, return_dict=True, "
                             "return_assistant_tokens_mask=True) returns it.")
        ids = ex["input_ids"]
        attention = ex.get("attention_mask")
        if attention is not None:
            att, n = _array(attention), _array(ids).size
            if att.shape != (n,) or att.dtype == object or not np.all(att == 1):
                raise UsageError(f"pack: example {i}'s attention_mask must be 1 for each of "
                                 f"its tokens, got {short(attention, 60)}: pack pads the rows "
                                 "itself. Fix: keep only the tokens where attention_mask is 1 "
                                 "(and their assistant_masks), or drop attention_mask.")
        what = f"example {i}'s assistant_masks"
        if "assistant_masks" in ex and ex["assistant_masks"] is None:
            _no_mask(what, "drop the key")
        return ids, ex.get("assistant_masks"), what
    if isinstance(ex, tuple) and len(ex) == 2 and _is_row(ex[0]):
        what = f"example {i}'s mask (the tuple's second item)"
        if ex[1] is None:
            _no_mask(what, "pass the ids alone, not a tuple")
        return ex[0], ex[1], what
    return ex, None, ""


def _no_mask(what: str, drop: str) -> NoReturn:
    """Refuses a mask given as ``None``: with no mask every token is learned, which a
    mask that went missing upstream (a tokenizer without generation blocks) must not
    silently become."""
    raise UsageError(f"pack: {what} is None, not a mask: a None mask would learn every "
                     "token, the prompt's too. Fix: a list of 0s and 1s, one per token (1 "
                     "where the token is to be learned); to learn every token, "
                     f"{drop}.")


def _mask(i: int, mask: Any, n: int, what: str) -> np.ndarray:
    """The per-token mask of example ``i`` (``n`` tokens): one 0 or 1 per token."""
    arr = _array(mask)
    if arr.ndim != 1 or not (arr.dtype == bool or np.issubdtype(arr.dtype, np.integer)):
        raise UsageError(f"pack: {what} must be a list of 0s and 1s (ints or bools), one per "
                         f"token, got {short(mask, 60)}. Fix: 1 where the token is to be "
                         "learned (the assistant's), 0 elsewhere.")
    if arr.size != n:
        raise UsageError(f"pack: {what} has {arr.size} values for the example's {n} tokens. "
                         "Fix: one 0 or 1 per token: take the ids and the mask from the same "
                         "apply_chat_template call, and cut both alike.")
    bad = np.flatnonzero((arr != 0) & (arr != 1))
    if bad.size:
        at = int(bad[0])
        hint = (" (labels, not a mask: assistant_masks=[int(t != -100) for t in labels])"
                if int(arr[at]) == -100 else "")
        raise UsageError(f"pack: {what} holds {int(arr[at])} at index {at}; a mask is 0 or 1 "
                         f"per token{hint}. Fix: 1 where the token is to be learned, 0 "
                         "elsewhere.")
    return arr.astype(bool)


def _examples(examples: Any, prompt_lengths: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """``examples`` as ``(ids, learn)`` pairs: ``learn[k]`` is whether token ``k``
    may be a target (a prompt's tokens, or a mask's 0s, may not)."""
    if isinstance(examples, str | bytes) or not isinstance(examples, Sequence | np.ndarray):
        one = " (one example: put it in a list)" if isinstance(examples, Mapping) else ""
        raise UsageError(f"pack: examples must be a list of token lists, got "
                         f"{type(examples).__name__} {short(examples, 60)}{one}. Fix: e.g. "
                         f"pack([[1, 2, 3], [4, 5]], length=8); {_MASKED}.")
    if prompt_lengths is not None and (
            isinstance(prompt_lengths, str | bytes) or not isinstance(prompt_lengths, Sequence | np.ndarray)
            or len(prompt_lengths) != len(examples)):
        got = len(prompt_lengths) if isinstance(prompt_lengths, Sequence | np.ndarray) else \
            short(prompt_lengths, 40)
        raise UsageError(f"pack: prompt_lengths must give one count per example ({len(examples)}), "
                         f"got {got}. Fix: prompt_lengths=[len(prompt) for prompt in prompts], "
                         "or None to train on every token.")
    out = []
    wide: list[int] = []   # the int64 examples, whose ids are checked all at once below
    for i, given in enumerate(examples):
        # A plain list is the common case: no ABC checks for it (they cost more than
        # the rest of an example's work).
        ex, mask, what = (given, None, "") if type(given) is list else _split(i, given)
        arr = _array(ex)
        if arr.ndim == 1 and arr.dtype == object and arr.size and all(
                type(t) is int for t in arr.tolist()):
            _check_ids(i, arr.tolist())   # Python ints past int64, kept as objects by NumPy
        if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
            raise UsageError(f"pack: example {i} must be a non-empty list of token ids, got "
                             f"{short(ex, 60)}. Fix: drop empty examples and pass ints ("
                             f"{_MASKED}).")
        if arr.dtype == np.int64:
            wide.append(i)
        else:
            _check_ids(i, arr)
        if mask is not None:
            if prompt_lengths is not None:
                raise UsageError(f"pack: example {i} carries its own mask and prompt_lengths "
                                 "is given too. Fix: one or the other: prompt_lengths=None "
                                 "(a mask of 0s on the prompt does what prompt_lengths does), "
                                 "or examples without masks.")
            learn = _mask(i, mask, arr.size, what)
        else:
            p = 0 if prompt_lengths is None else prompt_lengths[i]
            if isinstance(p, bool) or not isinstance(p, int | np.integer) or not 0 <= p <= arr.size:
                raise UsageError(f"pack: prompt_lengths[{i}] = {short(p, 40)} is not a count "
                                 f"from 0 to the example's {arr.size} tokens. Fix: the number "
                                 "of prompt tokens at the start of the example.")
            learn = np.arange(arr.size) >= int(p)
        out.append((arr.astype(np.int64, copy=False), learn))
    if wide:
        ids = np.concatenate([out[i][0] for i in wide])
        if ids.min() < 0 or ids.max() > _ID_MAX:
            for i in wide:
                _check_ids(i, out[i][0])
    return out


def pack(examples: Sequence[Any], length: int, *,
         prompt_lengths: Sequence[int] | None = None, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Variable-length examples packed into rows of ``length`` tokens for
    next-token training: a batch for :func:`nnx_shard.models.lm_loss` with the
    keys ``inputs``, ``targets``, ``segment_ids`` and ``positions``, each int32
    ``[rows, length]``.

    Examples go, longest first, into the first row with room for them whole
    (first-fit decreasing), so no example is split and rows stay close to full;
    finding that row takes ``log(rows)`` steps, so 100,000 examples pack in about a second.
    In each row:

    * ``inputs``: the examples' tokens one after the other, then ``pad_id``;
    * ``targets``: the next token of the same example, and :data:`IGNORE_INDEX`
      (-100) where there is none to learn: where the next token is one of the
      example's first ``prompt_lengths[i]`` tokens (the prompt) or is 0 in the
      example's own mask, at an example's last token (across the boundary to
      the next example), and on padding;
    * ``segment_ids``: 1, 2, ... for the row's examples, 0 for padding: the
      reference models attend within a segment only;
    * ``positions``: 0, 1, ... restarting with each example (0 on padding).

    Args:
      examples: token id lists, each of 1 to ``length`` tokens; or examples
        with their own per-token masks (1: learn the token, 0: do not), as
        dicts ``{"input_ids": ids, "assistant_masks": mask}`` (what
        :meth:`~nnx_shard.inference.Tokenizer.apply_chat_template` returns with
        ``return_dict=True, return_assistant_tokens_mask=True``; an
        ``attention_mask`` of 1s may come with them) or tuples ``(ids, mask)``.
        The mask is transformers' convention: token ``k + 1`` is the target at
        ``k`` where ``mask[k + 1]`` is 1, so every assistant turn of a
        conversation is learned and the rest is not.
      length: the tokens per row (at most int32's largest, and not so far beyond
        what the examples fill that the rows' padding would take more than 1 GiB).
      prompt_lengths: per example, how many of its first tokens are the prompt
        (never predicted); ``None`` trains on every next token (or on the
        examples' own masks, which it cannot be given with).
      pad_id: the input id of padding (never a target).

    Raises:
      UsageError: ``examples`` not a list of non-empty integer lists, a token id
        that is negative or that int32 cannot hold, an example longer than
        ``length``, ``prompt_lengths`` not one count in ``0 .. len(example)`` per
        example, a mask not one 0 or 1 per token (``None`` included), a mask with
        ``prompt_lengths``, a dict example with other keys or an
        ``attention_mask`` with 0s, a bad ``length`` or ``pad_id``; each
        naming the example's index.

    >>> from nnx_shard import pack
    >>> batch = pack([[1, 2, 3, 4], [5, 6, 7], [8, 9]], 6, prompt_lengths=[2, 1, 0])
    >>> batch["inputs"].tolist()
    [[1, 2, 3, 4, 8, 9], [5, 6, 7, 0, 0, 0]]
    >>> batch["targets"].tolist()
    [[-100, 3, 4, -100, 9, -100], [6, 7, -100, -100, -100, -100]]
    >>> batch["segment_ids"].tolist(), batch["positions"].tolist()
    ([[1, 1, 1, 1, 2, 2], [1, 1, 1, 0, 0, 0]], [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 0]])

    A conversation's masks (user, assistant, user, assistant):

    >>> chat = {"input_ids": [1, 2, 3, 4, 5, 6, 7], "assistant_masks": [0, 0, 1, 1, 0, 1, 1]}
    >>> pack([chat, ([8, 9, 10], [0, 1, 1])], 10)["targets"].tolist()
    [[-100, 3, 4, -100, 6, 7, -100, 9, 10, -100]]
    """
    if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 1:
        raise UsageError(f"pack: length must be a whole number of tokens >= 1, got "
                         f"{short(length, 40)}. Fix: e.g. length=2048.")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int | np.integer):
        raise UsageError(f"pack: pad_id must be a token id (int), got {short(pad_id, 40)}. "
                         "Fix: e.g. pad_id=0 (never a target, so any id in the vocabulary).")
    if not 0 <= pad_id <= _ID_MAX:
        raise UsageError(f"pack: pad_id {int(pad_id)} is not a token id: ids are 0 .. "
                         f"{_ID_MAX} (rows are int32). Fix: e.g. pad_id=0 (never a target, so "
                         "any id in the vocabulary).")
    if length > _ID_MAX:
        raise UsageError(f"pack: length {int(length)} is more tokens than a row's int32 "
                         f"positions count (at most {_ID_MAX}). Fix: a row length the model "
                         "trains on, e.g. length=2048.")
    items = _examples(examples, prompt_lengths)
    sizes = [ids.size for ids, _ in items]
    too_long = next((i for i, n in enumerate(sizes) if n > length), None)
    if too_long is not None:
        raise UsageError(f"pack: example {too_long} has {sizes[too_long]} tokens, more than a "
                         f"row's {length}. Fix: truncate it (e.g. ex[:{length}]) or pack into "
                         "longer rows.")
    order = sorted(range(len(items)), key=lambda j: -sizes[j])
    row_of, at_of, seg_of, n_rows = _first_fit([sizes[i] for i in order], int(length))
    _check_bytes(n_rows, int(length), sum(sizes))
    return _fill(items, order, row_of, at_of, seg_of, (n_rows, int(length)), pad_id)


#: The most bytes of padding :func:`pack` allocates in rows that are mostly padding.
#: First fit leaves every row but one more than half full, so the padding outgrows the
#: examples' own tokens only where ``length`` is far beyond what they fill.
_MAX_PADDING_BYTES = 1 << 30
#: The bytes one token takes in the batch: four int32 arrays.
_TOKEN_BYTES = 4 * np.dtype(np.int32).itemsize


def _check_bytes(n_rows: int, length: int, tokens: int) -> None:
    """Refuses rows that would be mostly padding, and more than
    :data:`_MAX_PADDING_BYTES` of it, before they are allocated."""
    padding = n_rows * length - tokens
    if padding > tokens and padding * _TOKEN_BYTES > _MAX_PADDING_BYTES:
        total = n_rows * length * _TOKEN_BYTES
        raise UsageError(f"pack: length {length} makes {n_rows} row(s) of {length} tokens "
                         f"for the examples' {tokens} tokens: {total / 2**30:.1f} GiB of "
                         f"arrays, {padding * _TOKEN_BYTES / 2**30:.1f} GiB of it padding "
                         f"(at most {_MAX_PADDING_BYTES / 2**30:.0f} GiB where the padding "
                         "outweighs the tokens). Fix: the model's sequence length, e.g. "
                         "length=2048, or more examples per call.")


def _first_fit(sizes: list[int], length: int) -> tuple[list[int], list[int], list[int], int]:
    """First fit of ``sizes`` in this order into rows of ``length``: each goes into the
    lowest-numbered row with room for it. Returns, per size, its row, its offset in the
    row and its segment number (1, 2, ... in the row), and the rows used.

    The rows' free room sits in a max segment tree, so finding the first row with room
    takes a walk from the root, not a scan of every row: ``n log n`` in all. Rows not yet
    opened hold ``length``, so the walk opens a new row where no open one has room. First
    fit leaves no two rows at most half full (the later one's first item would have fit
    in the earlier), which bounds the rows to ``2 x tokens / length + 1``.

    >>> _first_fit([4, 3, 2], 6)
    ([0, 1, 0], [0, 0, 4], [1, 1, 2], 2)
    """
    n = len(sizes)
    bound = min(n, 2 * sum(sizes) // length + 1) if n else 0
    leaves = 1
    while leaves < bound:
        leaves *= 2
    # Leaves past ``bound`` hold 0: never chosen, since a row within it always has room.
    tree = [0] * (2 * leaves)
    tree[leaves:leaves + bound] = [length] * bound
    for node in range(leaves - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    segments = [0] * bound
    row_of, at_of, seg_of = [0] * n, [0] * n, [0] * n
    used = 0
    for k, size in enumerate(sizes):
        node = 1
        while node < leaves:
            node = 2 * node if tree[2 * node] >= size else 2 * node + 1
        row = node - leaves
        at_of[k] = length - tree[node]
        segments[row] += 1
        row_of[k], seg_of[k] = row, segments[row]
        used = max(used, row + 1)
        tree[node] -= size
        node //= 2
        while node:
            left, right = tree[2 * node], tree[2 * node + 1]
            top = left if left >= right else right
            if tree[node] == top:  # the ancestors' maxima stand as they are
                break
            tree[node] = top
            node //= 2
    return row_of, at_of, seg_of, used


def _fill(items: list[tuple[np.ndarray, np.ndarray]], order: list[int], row_of: list[int],
          at_of: list[int], seg_of: list[int], shape: tuple[int, int],
          pad_id: int) -> dict[str, np.ndarray]:
    """The batch's four arrays, every example's tokens written in one scatter per array
    (``order[k]`` is the example placed ``k``-th)."""
    out = {"inputs": np.full(shape, pad_id, np.int32),
           "targets": np.full(shape, IGNORE_INDEX, np.int32),
           "segment_ids": np.zeros(shape, np.int32),
           "positions": np.zeros(shape, np.int32)}
    if not order:
        return out
    ids = np.concatenate([items[i][0] for i in order])
    learn = np.concatenate([items[i][1] for i in order])
    sizes = np.array([items[i][0].size for i in order], np.int64)
    starts = np.cumsum(sizes) - sizes            # each example's first token in ``ids``
    positions = np.arange(ids.size, dtype=np.int64) - np.repeat(starts, sizes)
    where = (np.repeat(np.array(row_of, np.int64) * shape[1] + np.array(at_of, np.int64),
                       sizes) + positions)
    # Token k's target is token k + 1 of the same example, kept where that one is to be
    # learned; an example's last token has none.
    last = positions == np.repeat(sizes - 1, sizes)
    following = np.append(ids[1:], 0)
    keep = np.append(learn[1:], False) & ~last
    out["inputs"].flat[where] = ids
    out["targets"].flat[where] = np.where(keep, following, IGNORE_INDEX)
    out["segment_ids"].flat[where] = np.repeat(np.array(seg_of, np.int64), sizes)
    out["positions"].flat[where] = positions
    return out
