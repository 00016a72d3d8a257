"""A direct call of a reference model with concrete token ids outside its vocabulary is
an error naming the ids and the vocabulary (the embedding lookup would read the last row
for -1 and give NaN past the end); traced ids cannot be read, and valid ones are unchanged."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_shard._errors import UsageError
from nnx_shard.models import Decoder, DecoderConfig, ReferenceConfig


def model(kind: str) -> nnx.Module:
    if kind == "llama":
        return Decoder(DecoderConfig(vocab=32, embed=16, heads=2, kv_heads=1, head_dim=8, mlp=32,
                                 layers=1, max_length=16), rngs=nnx.Rngs(0))
    return Decoder(ReferenceConfig(vocab=32, length=16, embed=16, heads=2, head_dim=8,
                                         mlp=32, layers=1), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kind", ["llama", "transformer"])
def test_ids_outside_the_vocabulary_are_refused(kind: str) -> None:
    m = model(kind)
    name = "Decoder"  # one decoder class builds both
    for ids, shown in [([1, -1, 2], "[-1]"), ([1, 32 + 5, 2], "[37]"), ([40, -3, 32], "[-3, 32, 40]")]:
        with pytest.raises(UsageError, match=rf"{name}.forward: tokens hold ids") as err:
            m(np.array([ids], np.int32))
        assert shown in str(err.value) and "vocabulary of 32" in str(err.value)
        with pytest.raises(UsageError, match=re.escape(f"{name}.forward: tokens hold ids {shown}")):
            m.forward(jnp.asarray([ids], jnp.int32))
    m.init_cache(batch=1, length=8)
    with pytest.raises(UsageError, match=rf"{name}.decode: tokens hold ids \[32\]"):
        m.decode(np.array([[1, 32]], np.int32))
    assert int(m.cache_index[...]) == 0   # refused before the cache moved


def test_many_bad_ids_are_listed_briefly() -> None:
    with pytest.raises(UsageError, match=r"tokens hold ids \[-9, -8, -7, 99\], outside"):
        model("transformer")(np.array([[-9, -8, -7, -6, 50, 99]], np.int32))


@pytest.mark.parametrize("kind", ["llama", "transformer"])
def test_valid_and_traced_ids(kind: str) -> None:
    m = model(kind)
    tokens = jnp.array([[0, 31, 5, 7]], jnp.int32)
    eager = np.asarray(m(tokens))
    assert eager.shape == (1, 4, 32) and np.isfinite(eager).all()
    # Under jit the ids are traced: nothing to read, the call compiles and runs.
    jitted = np.asarray(nnx.jit(lambda mod, t: mod(t))(m, tokens))
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "transformer"])
def test_tokens_with_no_row_or_no_position_are_refused(kind: str) -> None:
    # Static shapes: refused under jit too, before the attention's empty reductions.
    m = model(kind)
    name = "Decoder"  # one decoder class builds both
    for shape in ((0, 8), (2, 0)):
        tokens = jnp.zeros(shape, jnp.int32)
        for call in (m, lambda t: nnx.jit(lambda mm, tt: mm(tt))(m, t)):
            with pytest.raises(UsageError, match=re.escape(
                    f"{name}.forward: tokens of shape {shape} hold no token")) as info:
                call(tokens)
            assert "Fix:" in str(info.value)
    assert m(jnp.zeros((1, 1), jnp.int32)).shape == (1, 1, 32)
