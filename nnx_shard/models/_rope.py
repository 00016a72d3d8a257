"""Rotary position frequencies of :class:`~nnx_shard.models.Decoder` and the
``rope_scaling`` types it implements, computed as transformers 5
(``modeling_rope_utils``) computes them, in float32 where it does.

Each type gives ``(inv_freq [head_dim / 2], attention_factor)``; the model
multiplies the rotary ``cos`` and ``sin`` tables by the attention factor, as
transformers' rotary embedding does:

* ``default``: ``1 / theta ** (2i / d)``, factor 1;
* ``linear``: the default frequencies divided by ``factor`` (positions
  interpolated), factor 1;
* ``dynamic`` (dynamic NTK): the default frequencies while the sequence fits in
  ``max_position_embeddings``; past it, the base grows with the sequence length
  (``theta * (factor * L / max - (factor - 1)) ** (d / (d - 2))``), factor 1;
* ``yarn`` (Qwen2.5 / Qwen3 long context, DeepSeek): a ramp between
  interpolated and extrapolated frequencies over the dimensions whose
  rotations at ``original_max_position_embeddings`` fall between ``beta_slow``
  and ``beta_fast``; factor ``0.1 ln(factor) + 1`` (or from ``mscale`` /
  ``mscale_all_dim``, or ``attention_factor``);
* ``longrope`` (Phi-3 128k): the default frequencies divided by ``short_factor``
  while the sequence fits in ``original_max_position_embeddings``, by
  ``long_factor`` past it; factor ``sqrt(1 + ln(factor) / ln(original))`` with
  ``factor`` = ``max_position_embeddings / original`` unless given;
* ``llama3``: Llama 3.1's bands (low frequencies divided by ``factor``, high ones
  kept, a smooth blend between), factor 1.

The sequence length (``dynamic`` and ``longrope``) is transformers' ``max(position_ids)
+ 1``, taken per call and never remembered: a forward pass over ``[batch, L]``
uses ``L`` (its static length), a call with explicit positions or a padding mask
the highest position + 1, and each decoding step its own position + 1, as
transformers' generation reaches it step by step (keys already in the cache keep
the rotation they were stored with, as in transformers). transformers keeps the
frequencies of the longest sequence seen between calls of one module (until a
call shorter than ``max_position_embeddings`` resets them); a model here is a
function of its inputs, so a call never depends on the one before.

>>> import numpy as np
>>> from nnx_shard.models import DecoderConfig
>>> cfg = DecoderConfig(head_dim=4, rope_scaling={"rope_type": "linear", "factor": 2.0})
>>> frequencies(cfg)
(array([0.5  , 0.005], dtype=float32), 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard._errors import UsageError, count, short

__all__ = ["ROPE_TYPES", "check_tables", "checked", "frequencies", "frequencies_at"]

#: ``rope_scaling`` types the model implements (``"default"``: none).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
#: The types whose frequencies depend on the sequence length.
BY_LENGTH = ("dynamic", "longrope")
# Keys each type reads (besides rope_type): required, then optional.
_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate")),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"),
                 ("factor", "attention_factor")),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
}
_F32 = np.float32
_FIX = "Fix: use the checkpoint's own config.json"


def _params(cfg: Any) -> dict[str, Any]:
    return dict(cfg.rope_scaling) if cfg.rope_scaling else {"rope_type": "default"}


def _exponent(d: int) -> np.ndarray:
    # transformers: torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return np.arange(0, d, 2, dtype=np.int64).astype(_F32) / _F32(d)


def _plain(theta: float, d: int) -> np.ndarray:
    return (_F32(1.0) / (_F32(theta) ** _exponent(d))).astype(_F32)


def default(cfg: Any, theta: float | None = None) -> tuple[np.ndarray, float]:
    """Unscaled frequencies (of base ``theta``, else ``cfg.rope_theta``).

    >>> from nnx_shard.models import DecoderConfig
    >>> default(DecoderConfig(head_dim=4, rope_theta=100.0))
    (array([1. , 0.1], dtype=float32), 1.0)
    """
    return _plain(cfg.rope_theta if theta is None else theta, cfg.head_dim), 1.0


def linear(cfg: Any) -> tuple[np.ndarray, float]:
    """Linear (position interpolation): frequencies divided by ``factor``.

    >>> from nnx_shard.models import DecoderConfig
    >>> linear(DecoderConfig(head_dim=4, rope_theta=100.0,
    ...                    rope_scaling={"rope_type": "linear", "factor": 4.0}))
    (array([0.25 , 0.025], dtype=float32), 1.0)
    """
    factor = _params(cfg)["factor"]
    return (_plain(cfg.rope_theta, cfg.head_dim) / _F32(factor)).astype(_F32), 1.0


def dynamic(cfg: Any, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Dynamic NTK: the default frequencies up to ``max_length``
    (``max_position_embeddings``), a larger base past it, in float32 as
    transformers computes it from the length tensor.

    >>> from nnx_shard.models import DecoderConfig
    >>> cfg = DecoderConfig(head_dim=4, rope_theta=100.0, max_length=8,
    ...                   rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    >>> dynamic(cfg, 8)[0], dynamic(cfg, 16)[0]
    (array([1. , 0.1], dtype=float32), array([1.        , 0.03333334], dtype=float32))
    """
    d, theta, top = cfg.head_dim, cfg.rope_theta, cfg.max_length
    factor = float(_params(cfg)["factor"])
    if seq_len is None or seq_len <= top:
        # transformers' initial frequencies: the Python-float formula at seq_len = max
        base = theta * ((factor * top / top) - (factor - 1)) ** (d / (d - 2))
        return _plain(base, d), 1.0
    grown = (_F32(factor) * _F32(seq_len) / _F32(top) - _F32(factor - 1)) ** _F32(d / (d - 2))
    base32 = _F32(theta) * grown
    return (_F32(1.0) / (base32 ** _exponent(d))).astype(_F32), 1.0


def _dynamic_at(cfg: Any, seq_len: jax.Array) -> jax.Array:
    """:func:`dynamic`'s frequencies for a traced length (float32, as above)."""
    d, theta, top = cfg.head_dim, cfg.rope_theta, cfg.max_length
    factor = float(_params(cfg)["factor"])
    length = jnp.maximum(seq_len, top).astype(jnp.float32)
    grown = (jnp.float32(factor) * length / jnp.float32(top) - jnp.float32(factor - 1)
             ) ** jnp.float32(d / (d - 2))
    grown_inv = 1.0 / ((jnp.float32(theta) * grown) ** jnp.asarray(_exponent(d)))
    return jnp.where(seq_len > top, grown_inv, jnp.asarray(dynamic(cfg)[0]))


def _yarn_factor(s: Mapping[str, Any], factor: float) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = s.get("mscale"), s.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def yarn(cfg: Any) -> tuple[np.ndarray, float]:
    """YaRN: interpolated frequencies (divided by ``factor``) for the dimensions
    that turn fewer than ``beta_slow`` times over ``original_max_position_embeddings``,
    the unscaled ones for those turning more than ``beta_fast`` times, a linear ramp
    between; the attention factor of the paper (``0.1 ln(factor) + 1``).

    >>> from nnx_shard.models import DecoderConfig
    >>> cfg = DecoderConfig(head_dim=8, rope_theta=10000.0, rope_scaling={
    ...     "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})
    >>> inv, scale = yarn(cfg)
    >>> (inv / default(cfg)[0]).round(4), round(scale, 4)   # kept, blended, divided by 4
    (array([1.   , 0.625, 0.25 , 0.25 ], dtype=float32), 1.1386)
    """
    s, d, theta = _params(cfg), cfg.head_dim, cfg.rope_theta
    old = s["original_max_position_embeddings"]
    factor = s["factor"] if s.get("factor") is not None else cfg.max_length / old
    scale = _yarn_factor(s, factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def turns(rotations: float) -> float:
        return (d * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = turns(fast), turns(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=_F32) - _F32(low)) / _F32(high - low), 0, 1)
    extrapolate = _F32(1) - ramp.astype(_F32)
    pos = _F32(theta) ** _exponent(d)
    inv = ((_F32(1.0) / (_F32(factor) * pos)) * (_F32(1) - extrapolate)
           + (_F32(1.0) / pos) * extrapolate)
    return inv.astype(_F32), scale


def _longrope_factor(cfg: Any, s: Mapping[str, Any]) -> float:
    old = s["original_max_position_embeddings"]
    factor = s.get("factor")
    if factor is None:
        factor = cfg.max_length / old
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))


def longrope(cfg: Any, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """LongRoPE: the default frequencies divided by ``short_factor`` (a number per
    frequency) up to ``original_max_position_embeddings``, by ``long_factor`` past it.

    >>> from nnx_shard.models import DecoderConfig
    >>> cfg = DecoderConfig(head_dim=4, rope_theta=100.0, max_length=64, rope_scaling={
    ...     "rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [4.0, 8.0],
    ...     "original_max_position_embeddings": 16})
    >>> longrope(cfg, 16)[0], longrope(cfg, 17)[0], round(longrope(cfg)[1], 4)
    (array([1.  , 0.05], dtype=float32), array([0.25  , 0.0125], dtype=float32), 1.2247)
    """
    s = _params(cfg)
    long = seq_len is not None and seq_len > s["original_max_position_embeddings"]
    ext = np.asarray(s["long_factor" if long else "short_factor"], _F32)
    inv = _F32(1.0) / (ext * (_F32(cfg.rope_theta) ** _exponent(cfg.head_dim)))
    return inv.astype(_F32), _longrope_factor(cfg, s)


def llama3(cfg: Any) -> tuple[np.ndarray, float]:
    """Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth
    blend in the band between (float32, as transformers).

    >>> from nnx_shard.models import get_config
    >>> llama3(get_config("llama3-8b"))[0][[0, -1]]
    array([1.000000e+00, 3.068926e-07], dtype=float32)
    """
    s = _params(cfg)
    inv = _plain(cfg.rope_theta, cfg.head_dim)
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(_F32), 1.0


def frequencies(cfg: Any, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """``(inv_freq [head_dim / 2] float32, attention_factor)`` of ``cfg`` (anything
    with ``head_dim``, ``rope_theta``, ``rope_scaling`` and ``max_length``, as
    :class:`~nnx_shard.models.DecoderConfig`) for a sequence of ``seq_len`` positions
    (``None``: transformers' initial frequencies, those of a short sequence).

    >>> from nnx_shard.models import get_config
    >>> frequencies(get_config("llama-tiny"))
    (array([1.   , 0.1  , 0.01 , 0.001], dtype=float32), 1.0)
    """
    kind = _params(cfg)["rope_type"]
    if kind == "dynamic":
        return dynamic(cfg, seq_len)
    if kind == "longrope":
        return longrope(cfg, seq_len)
    return {"default": default, "linear": linear, "yarn": yarn, "llama3": llama3}[kind](cfg)


def frequencies_at(cfg: Any, seq_len: jax.Array) -> tuple[jax.Array, float]:
    """:func:`frequencies` for a traced ``seq_len`` (a decoding step's position + 1,
    or the highest of per-token positions + 1): the frequencies as a traced array,
    chosen (``longrope``) or computed (``dynamic``) on the device.

    >>> from nnx_shard.models import DecoderConfig
    >>> cfg = DecoderConfig(head_dim=4, rope_theta=100.0, max_length=8,
    ...                   rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    >>> inv, _ = frequencies_at(cfg, jnp.asarray(16))
    >>> bool(jnp.allclose(inv, dynamic(cfg, 16)[0], rtol=1e-6))
    True
    """
    s = _params(cfg)
    if s["rope_type"] == "dynamic":
        return _dynamic_at(cfg, seq_len), 1.0
    if s["rope_type"] == "longrope":
        short_inv, scale = longrope(cfg)
        long_inv, _ = longrope(cfg, s["original_max_position_embeddings"] + 1)
        return jnp.where(seq_len > s["original_max_position_embeddings"],
                         jnp.asarray(long_inv), jnp.asarray(short_inv)), scale
    inv, scale = frequencies(cfg)
    return jnp.asarray(inv), scale


def _number(value: Any, name: str, where: str, *, least: float = 0.0,
            strict: bool = True) -> float:
    try:
        ok = (isinstance(value, int | float) and not isinstance(value, bool)
              and math.isfinite(value) and (value > least if strict else value >= least))
    except OverflowError:
        ok = False
    if not ok:
        bound = f"> {least:g}" if strict else f">= {least:g}"
        raise UsageError(f"{where}: {name} must be a finite number {bound}, got "
                         f"{short(value, 60)} ({type(value).__name__}). {_FIX}.")
    return float(value)


def _factors(value: Any, name: str, where: str, head_dim: int | None) -> tuple[float, ...]:
    """A longrope factor list: one finite number > 0 per rotary frequency."""
    want = "" if head_dim is None else f" ({head_dim // 2}: head_dim / 2)"
    if not isinstance(value, list | tuple):
        raise UsageError(f"{where}: {name} must be a list of numbers, one per rotary "
                         f"frequency{want}, got {short(value, 60)} ({type(value).__name__}). "
                         f"{_FIX}.")
    out = tuple(_number(v, f"{name}[{i}]", where) for i, v in enumerate(value))
    if head_dim is not None and len(out) != head_dim // 2:
        raise UsageError(f"{where}: {name} has {len(out)} numbers; head_dim {head_dim} "
                         f"rotates {head_dim // 2} frequencies, one factor each. {_FIX}, "
                         "whose head_dim matches the factors.")
    return out


def checked(items: Mapping[str, Any], where: str, key: str,
            head_dim: int | None = None) -> dict[str, Any] | None:
    """The scaling parameters of ``items`` (``where``'s ``key``: a ``rope_scaling``
    dict), checked as transformers checks them and with the keys its type reads
    (``type``, the old spelling, becomes ``rope_type``; lists become tuples, so the
    config stays hashable); ``None`` for ``default``. Each problem is a
    :class:`~nnx_shard._errors.UsageError` naming the field, with a fix.

    >>> checked({"type": "yarn", "factor": 4, "original_max_position_embeddings": 32768},
    ...         "config.json", "rope_scaling")
    {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32768}
    >>> checked({"rope_type": "linear"}, "config.json", "rope_scaling")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: config.json: rope_scaling of type 'linear' lacks ['factor']. Fix: give every one of factor (as the checkpoint's config.json does).
    """
    kind = items.get("rope_type", items.get("type", "default"))
    if not isinstance(kind, str):
        raise UsageError(f"{where}: {key}: rope_type {short(kind, 60)} is not a name. Fix: "
                         "e.g. \"rope_type\": \"yarn\".")
    if kind not in ROPE_TYPES:
        raise UsageError(
            f"{where}: {key} of type {short(kind, 40)} is not implemented (implemented: "
            f"{', '.join(repr(t) for t in ROPE_TYPES)}). Fix: use a checkpoint without that "
            "scaling, or add it to nnx_shard.models._rope.")
    if kind == "default":
        return None
    required, optional = _KEYS[kind]
    missing = [k for k in required if k not in items]
    if missing:
        raise UsageError(f"{where}: {key} of type {kind!r} lacks {missing}. Fix: give every "
                         f"one of {', '.join(required)} (as the checkpoint's config.json does).")
    out: dict[str, Any] = {"rope_type": kind}
    for name in (*required, *optional):
        if name not in items:
            continue
        value, label = items[name], f"{key}['{name}']"
        if name in ("short_factor", "long_factor"):
            out[name] = _factors(value, label, where, head_dim)
        elif name == "original_max_position_embeddings":
            out[name] = count(value, f"{where}: {label}",
                              fix="the pretraining context length, e.g. 8192")
        elif name == "truncate":
            if not isinstance(value, bool):
                raise UsageError(f"{where}: {label} must be true or false, got "
                                 f"{short(value, 60)}. Fix: write \"truncate\": true.")
            out[name] = value
        elif value is None and (name in optional or (kind == "yarn" and name == "factor")):
            out[name] = None  # transformers' default (yarn: max / original for a null factor)
        elif name == "factor":
            out[name] = _number(value, label, where, least=1.0, strict=False)
        elif name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            out[name] = _number(value, label, where, strict=False)
        else:
            out[name] = _number(value, label, where)
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise UsageError(f"{where}: {key}['high_freq_factor'] ({out['high_freq_factor']}) must "
                         f"be greater than {key}['low_freq_factor'] ({out['low_freq_factor']}): "
                         f"the band between them divides by their difference. {_FIX}.")
    return out


def _longest(cfg: Any) -> int:
    """The most positions a sequence of ``cfg`` reaches: ``max_length``, or ``factor``
    times it under ``dynamic`` scaling (:attr:`~nnx_shard.models.Decoder.max_length`)."""
    s = _params(cfg)
    if s["rope_type"] == "dynamic":
        return max(int(cfg.max_length * float(s["factor"])), cfg.max_length)
    return cfg.max_length


def _named(s: Mapping[str, Any], names: tuple[str, ...]) -> str:
    given = [f"rope_scaling['{n}']={short(s[n], 40)}" for n in names if s.get(n) is not None]
    return ", ".join(given) or f"rope_scaling['{names[0]}']"


def _finite(inv: np.ndarray, positions: int) -> bool:
    # The angles grow with the position: the last position's being finite is every one's.
    inv = np.asarray(inv, _F32)
    return bool(np.all(np.isfinite(inv)) and np.all(np.isfinite(
        inv * _F32(max(positions - 1, 0)))))


def _scale_ok(scale: float) -> bool:
    # The factor multiplies both the query's and the key's rotation tables, so the
    # attention scores carry its square: that must stay inside float32's range.
    try:
        f32 = _F32(scale)
    except OverflowError:
        return False
    return bool(np.isfinite(f32) and np.isfinite(f32 * f32) and f32 > 0)


#: The ``rope_scaling`` keys the frequencies of each type come from (for the
#: messages); the attention factor's come from :func:`_scale_fields`.
_FREQ_FIELDS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",), "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}


def _scale_fields(s: Mapping[str, Any]) -> tuple[str, ...]:
    if s.get("attention_factor") is not None:
        return ("attention_factor",)
    if s["rope_type"] == "yarn" and s.get("mscale") and s.get("mscale_all_dim"):
        return ("mscale", "mscale_all_dim")
    return ("factor", "original_max_position_embeddings")


def _check_divisions(cfg: Any, s: Mapping[str, Any], where: str) -> None:
    """Refuses the settings whose rotary formula divides by zero."""
    kind, d, theta = s["rope_type"], cfg.head_dim, cfg.rope_theta
    if kind == "dynamic" and d == 2:
        raise UsageError(f"{where}: head_dim=2 with rope_scaling of type 'dynamic': its grown "
                         "base has the exponent head_dim / (head_dim - 2), a division by "
                         "zero. Fix: head_dim >= 4 (as every dynamic-NTK checkpoint has), "
                         "or another rope_type.")
    if kind == "yarn" and theta == 1.0:
        raise UsageError(f"{where}: rope_theta=1.0 with rope_scaling of type 'yarn': the "
                         "ramp's bounds divide by ln(rope_theta) = 0. Fix: the checkpoint's "
                         "rope_theta, e.g. 10000.0 or 1000000.0.")
    if kind == "longrope" and s.get("attention_factor") is None:
        old = s["original_max_position_embeddings"]
        factor = s.get("factor")
        if factor is None:
            factor = cfg.max_length / old
        if old == 1 and factor > 1.0:
            raise UsageError(f"{where}: rope_scaling['original_max_position_embeddings']=1 "
                             "(rope_type 'longrope'): its attention factor divides by "
                             "ln(original_max_position_embeddings) = 0. Fix: the pretraining "
                             "context length, e.g. 4096, or give attention_factor.")


def check_tables(cfg: Any, where: str = "DecoderConfig") -> None:
    """Refuses a rotary configuration whose frequencies or attention factor are not
    finite numbers in float32 (computed on the host for every sequence length the
    model reaches, as the model computes them) or whose formula divides by zero:
    values that each pass their own check can still make every logit NaN (a
    ``dynamic`` factor of ``1e17`` cancels the grown base to 0, a ``rope_theta`` of
    ``1e-50`` is 0 in float32). Each problem is a
    :class:`~nnx_shard._errors.UsageError` naming the field, its value and the fix.

    >>> from nnx_shard.models import DecoderConfig
    >>> DecoderConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0,
    ...             "original_max_position_embeddings": 256, "attention_factor": 1e30})
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: DecoderConfig: rope_scaling['attention_factor']=1e+30 (rope_type 'yarn') gives the rotary attention factor 1e+30, whose square, scaling every attention score, is past float32's range: every logit would be NaN. Fix: use the checkpoint's own config.json (attention factors are near 1, e.g. 1.2).
    """
    s = _params(cfg)
    kind, d, theta = s["rope_type"], cfg.head_dim, cfg.rope_theta
    _check_divisions(cfg, s, where)
    top = _longest(cfg)
    problem = "every logit would be NaN. " + _FIX
    with np.errstate(all="ignore"):
        if not _finite(default(cfg)[0], top):
            raise UsageError(f"{where}: rope_theta={short(theta, 40)} gives rotary "
                             f"frequencies 1 / rope_theta ** (2i / {d}) that are not finite in "
                             f"float32 over {top} positions: {problem} (rotary bases are "
                             "large, e.g. 10000.0 or 1000000.0).")
        local = cfg.local_theta()
        if local and not _finite(default(cfg, local)[0], top):
            raise UsageError(f"{where}: rope_local_theta={short(local, 40)} gives rotary "
                             f"frequencies that are not finite in float32 over {top} "
                             f"positions: {problem} (e.g. 10000.0).")
        if kind == "default":
            return
        lengths: list[int | None] = [None]
        if kind == "dynamic":
            lengths.append(top)
        if kind == "longrope":
            lengths.append(s["original_max_position_embeddings"] + 1)
        for length in lengths:
            try:
                inv, scale = frequencies(cfg, length)
            except (ZeroDivisionError, OverflowError, ValueError) as e:
                raise UsageError(f"{where}: rope_scaling of type {kind!r} "
                                 f"({_named(s, _FREQ_FIELDS[kind])}, rope_theta="
                                 f"{short(theta, 40)}) cannot be computed ({e}). "
                                 f"{_FIX}.") from None
            if not _finite(inv, top):
                fields = _FREQ_FIELDS[kind]
                if kind == "longrope":
                    fields = ("long_factor",) if length else ("short_factor",)
                raise UsageError(f"{where}: {_named(s, fields)} (rope_type {kind!r}) gives "
                                 f"rotary frequencies that are not finite in float32 over "
                                 f"{top} positions: {problem} (scaling factors are small "
                                 "numbers, e.g. 2.0 or 8.0).")
            if not _scale_ok(scale):
                raise UsageError(f"{where}: {_named(s, _scale_fields(s))} (rope_type {kind!r}) "
                                 f"gives the rotary attention factor {short(scale, 40)}, whose "
                                 "square, scaling every attention score, is past float32's "
                                 f"range: every logit would be NaN. {_FIX} (attention factors "
                                 "are near 1, e.g. 1.2).")
