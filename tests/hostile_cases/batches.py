"""Hostile values in training batches: token ids ``ns.pack`` cannot write, masks of 2,
targets past the vocabulary or below -100, negative positions given to ``Trainer.fit``
(whose compiled step cannot read them: the feed checks them on the host), and token ids
outside the vocabulary given to a model directly."""

from __future__ import annotations

from typing import Any


def build(hs: Any) -> None:
    F = hs.F

    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    def pack(examples: Any, **kw: Any) -> Any:
        return ns().pack(examples, 8, **kw)

    def big_uint() -> Any:
        import numpy as np

        return [np.array([1, 2**63], np.uint64)]

    for label, fn, names in [
        ("pack_id_2_40", lambda: pack([[1, 2], [3, 2**40]]), ("example 1", "1099511627776")),
        ("pack_uint64_2_63", lambda: pack(big_uint()), ("example 0", "9223372036854775808")),
        ("pack_negative_id", lambda: pack([[4, -7]]), ("example 0", "-7")),
        ("pack_id_past_int64", lambda: pack([[1, 2**70]]), ("example 0", str(2**70))),
        ("pack_pad_negative", lambda: pack([[1]], pad_id=-1), "pad_id"),
        ("pack_pad_past_int32", lambda: pack([[1]], pad_id=2**31), "pad_id"),
    ]:
        hs.api(f"batches/{label}", names, fn)

    # -- Trainer.fit on a user model: the keys the library knows by name -----------------

    def on_x(m: Any, b: Any) -> Any:
        import jax.numpy as jnp

        return jnp.mean((m(b["x"]) - 1.0) ** 2)

    def user_fit(key: str, value: int, *, at: int = 1, whole: bool = False) -> Any:
        import numpy as np

        x = np.ones((8, 2), np.float32)
        good = {"x": x, key: np.zeros((8, 4), np.int32)}
        data = [good] * 4
        data[at] = {"x": x, key: np.full((8, 4), value, np.int32)}
        if whole:
            data = ns().Batches({k: np.concatenate([b[k] for b in data]) for k in good}, 8)
        return F.fit(F.trainer(on_x), data=data, num_steps=4)

    for label, key, value, kw in [
        ("fit_mask_two", "attention_mask", 2, {}),
        ("fit_mask_minus_one", "attention_mask", -1, {}),
        ("fit_mask_seven_later_group", "attention_mask", 7, {"at": 3}),
        ("fit_mask_two_batches_window", "attention_mask", 2, {"whole": True, "at": 2}),
        ("fit_labels_minus_seven", "labels", -7, {}),
        ("fit_targets_below_ignore", "targets", -101, {}),
        ("fit_positions_negative", "positions", -1, {}),
        ("fit_input_ids_negative", "input_ids", -1, {}),
    ]:
        hs.api(f"batches/{label}", (f"['{key}'] = {value}",),
               lambda key=key, value=value, kw=kw: user_fit(key, value, **kw))

    # -- Trainer.fit on a Llama with lm_loss: the model's vocabulary and context ---------

    trainers: list[Any] = []  # one for the seven cases: the feed refuses before a step

    def llama_trainer() -> Any:
        import optax
        from flax import nnx

        from nnx_shard.models import Decoder, DecoderConfig, lm_loss

        if not trainers:
            cfg = DecoderConfig(vocab=32, embed=16, heads=2, kv_heads=1, head_dim=8, mlp=32,
                                layers=1, max_length=16)
            s = ns().strategies.get("dp")
            mesh = s.make_mesh(8)
            # Zero weights in the dp layout: the feed reads the batches, never a weight,
            # and a sharded random init compiles.
            model = hs.zero_filled(ns().abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)),
                                                      mesh, s))
            opt = ns().sharded_optimizer(model, optax.sgd(0.1), mesh, s)
            trainers.append(ns().Trainer(model, opt, lm_loss, mesh=mesh, rules=s,
                                         steps_per_call=2))
        return trainers[0]

    def llama_fit(key: str, value: int) -> Any:
        import numpy as np

        trainer = llama_trainer()
        tokens = np.ones((8, 8), np.int32)
        batch = {"inputs": tokens, "targets": tokens, "attention_mask": tokens,
                 "positions": np.zeros((8, 8), np.int32)}
        bad = dict(batch)
        bad[key] = bad[key].copy()
        bad[key][3, 4] = value
        return trainer.fit([batch, bad], 2, progress=False)

    for label, key, value in [
        ("llama_fit_target_vocab", "targets", 32),
        ("llama_fit_target_past_vocab", "targets", 37),
        ("llama_fit_target_minus_five", "targets", -5),
        ("llama_fit_inputs_past_vocab", "inputs", 40),
        ("llama_fit_inputs_negative", "inputs", -1),
        ("llama_fit_positions_past_context", "positions", 16),
        ("llama_fit_mask_two", "attention_mask", 2),
    ]:
        hs.api(f"batches/{label}", (f"['{key}'] = {value}",),
               lambda key=key, value=value: llama_fit(key, value))

    # -- a direct model call with concrete token ids --------------------------------------

    made: dict[str, Any] = {}  # one model per kind for the worker: building one compiles

    def call(kind: str, value: int, *, decode: bool = False) -> Any:
        import numpy as np
        from flax import nnx

        from nnx_shard.models import Decoder, DecoderConfig, ReferenceConfig

        if kind not in made:
            cfg = (DecoderConfig(vocab=32, embed=16, heads=2, kv_heads=1, head_dim=8, mlp=32,
                                 layers=1, max_length=16) if kind == "llama" else
                   ReferenceConfig(vocab=32, length=16, embed=16, heads=2, head_dim=8, mlp=32,
                                   layers=1))
            # Zero weights: the ids are checked before any weight is read, and an eager
            # random init compiles one program per shape (seconds).
            made[kind] = hs.zero_filled(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
        model = made[kind]
        tokens = np.array([[1, value, 2]], np.int32)
        if decode:
            model.init_cache(batch=1, length=8)
            return model.decode(tokens)
        return model(tokens)

    for label, kind, value, kw in [
        ("llama_token_minus_one", "llama", -1, {}),
        ("llama_token_past_vocab", "llama", 32 + 5, {}),
        ("llama_decode_token_past_vocab", "llama", 32, {"decode": True}),
        ("transformer_token_minus_one", "transformer", -1, {}),
        ("transformer_decode_token_negative", "transformer", -3, {"decode": True}),
    ]:
        hs.api(f"batches/{label}", (f"ids [{value}]",),
               lambda kind=kind, value=value, kw=kw: call(kind, value, **kw))
