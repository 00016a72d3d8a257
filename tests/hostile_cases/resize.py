"""Hostile cases of ``ns.models.resize_token_embeddings``: sizes that are not ones
(zero, negative, bool, float, text, beyond int32 ids), bad ``pad_to_multiple_of``,
``mean_resizing``, ``seed`` and ``rules``, models without a token embedding (a plain
layer, an abstract model, a config without a vocab, a mis-shaped table) and a size
its devices do not divide.

A refused call must leave the model as it was: a table or config changed by a
failed call makes the case ``raw`` (an AssertionError of this file).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def build(hs: Any) -> None:
    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    def untouched(model: Any, fn: Callable[[Any], Any]) -> Any:
        """Runs ``fn(model)``; raises AssertionError (raw) if a failed call changed it."""
        vocab, value = model.cfg.vocab, model.token_embed.get_value()
        head = None if model.unembed is None else model.unembed.get_value()
        try:
            return fn(model)
        finally:
            same_head = model.unembed is None or model.unembed.get_value() is head
            if (model.cfg.vocab != vocab or model.token_embed.get_value() is not value
                    or not same_head):
                raise AssertionError("the model changed under a refused resize")

    def resize(*args: Any, model: Any = None, **kw: Any) -> Any:
        m = hs._tiny_llama() if model is None else model
        return untouched(m, lambda mm: ns().models.resize_token_embeddings(mm, *args, **kw))

    for label, size in [("zero", 0), ("negative", -3), ("bool", True), ("float", 130.0),
                        ("nan", float("nan")), ("str", "131"), ("none", None),
                        ("huge", 2**40), ("numpy_float", "NP_FLOAT")]:
        if size == "NP_FLOAT":
            def call() -> Any:
                import numpy as np

                return resize(np.float32(131))
            hs.api(f"resize/new_vocab_{label}", "new_vocab", call)
        else:
            hs.api(f"resize/new_vocab_{label}", "new_vocab", lambda s=size: resize(s))
    hs.api("resize/pad_beyond_int32", ("new_vocab", "pad_to_multiple_of"),
           lambda: resize(2**31 - 5, pad_to_multiple_of=64))
    for label, pad in [("zero", 0), ("negative", -1), ("bool", True), ("float", 8.0),
                       ("str", "8")]:
        hs.api(f"resize/pad_to_multiple_of_{label}", "pad_to_multiple_of",
               lambda p=pad: resize(130, pad_to_multiple_of=p))
    for label, flag in [("str", "yes"), ("int", 1), ("none", None)]:
        hs.api(f"resize/mean_resizing_{label}", "mean_resizing",
               lambda f=flag: resize(130, mean_resizing=f))
    for label, seed in [("negative", -1), ("float", 0.5), ("bool", False), ("huge", 2**70),
                        ("str", "0")]:
        hs.api(f"resize/seed_{label}", "seed", lambda s=seed: resize(130, seed=s))
    hs.api("resize/rules_str", "rules", lambda: resize(130, rules="fsdp"))
    hs.api("resize/rules_int", "rules", lambda: resize(130, rules=3))

    # Models it cannot resize -------------------------------------------------------------
    def linear() -> Any:
        from flax import nnx

        return ns().models.resize_token_embeddings(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), 8)

    hs.api("resize/model_linear", ("model", "token_embed"), linear)
    hs.api("resize/model_none", ("model", "token_embed"),
           lambda: ns().models.resize_token_embeddings(None, 8))
    hs.api("resize/model_state", ("model", "token_embed"),
           lambda: ns().models.resize_token_embeddings(
               __import__("flax").nnx.state(hs._tiny_llama()), 8))

    def abstract() -> Any:
        from flax import nnx

        model = ns().abstract_init(lambda: ns().models.Decoder(ns().models.DecoderConfig(),
                                                               rngs=nnx.Rngs(0)),
                                   "data=8", ns().strategies.get("fsdp"))
        return ns().models.resize_token_embeddings(model, 136)

    hs.api("resize/model_abstract", ("model", "abstract"), abstract)

    def no_vocab() -> Any:
        from flax import nnx

        class Embedder(nnx.Module):
            def __init__(self) -> None:
                self.cfg = {"vocab": 8}
                self.token_embed = nnx.Param(nnx.initializers.normal()(
                    __import__("jax").random.key(0), (8, 4)))

        return ns().models.resize_token_embeddings(Embedder(), 9)

    hs.api("resize/model_cfg_without_vocab", ("cfg", "vocab"), no_vocab)

    def transposed() -> Any:
        import jax.numpy as jnp

        model = hs._tiny_llama()
        model.token_embed.set_value(jnp.zeros((32, 128)))
        return resize(130, model=model)

    hs.api("resize/model_table_transposed", ("token_embed", "shape"), transposed)

    def head_not_param() -> Any:
        from flax import nnx

        model = hs._tiny_llama()
        model.unembed = nnx.data(nnx.BatchStat(model.unembed.get_value()))
        return ns().models.resize_token_embeddings(model, 130)

    hs.api("resize/model_head_not_param", "unembed", head_not_param)

    # Layouts ------------------------------------------------------------------------------
    made: list[Any] = []  # one model for the three cases: a refused resize leaves it as it was

    def tp_model() -> Any:
        """A Llama laid out by the tp preset, its tables zeros in the shardings
        ``sharded_init`` gives them: the refusals read shapes and shardings, never values,
        and a sharded random init compiles for seconds."""
        from flax import nnx

        if not made:
            made.append(hs.zero_filled(ns().abstract_init(lambda: ns().models.Decoder(
                ns().models.DecoderConfig(), rngs=nnx.Rngs(0)), "data=4,model=2",
                ns().strategies.get("tp"))))
        return made[0]

    hs.api("resize/indivisible_over_tp", ("new_vocab", "pad_to_multiple_of"),
           lambda: resize(131, model=tp_model()))
    hs.api("resize/indivisible_under_rules", ("new_vocab", "pad_to_multiple_of"),
           lambda: resize(131, model=tp_model(), rules=ns().strategies.get("tp")))
    hs.api("resize/rules_missing_axis", ("rules", "new_vocab", "vocab"),
           lambda: resize(136, model=tp_model(), rules={"vocab": "nope", "embed": None}))
