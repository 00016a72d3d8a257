"""Hostile cases of the routes that delegate: ``ns.restore``, ``ns.pipeline.stage_report``,
``Checkpointer.save`` / ``restore`` and ``Trainer``'s options checked by ``multistep``'s
code. Each must be as clear as the call it delegates to."""

from __future__ import annotations

from typing import Any


def build(hs: Any) -> None:
    F = hs.F

    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    hs.api("routes/restore_missing_dir", ("restore", "does not exist"),
           lambda: ns().restore(F.path("routes_nowhere"), model=F.model()))
    hs.api("routes/restore_model_int", ("restore", "model"),
           lambda: ns().restore(F.dir("routes_empty"), model=5))

    def saved() -> str:
        d = F.dir("routes_ckpt")
        import os

        if not os.path.isdir(os.path.join(d, "1")):
            ns().save(d, 1, model=F.model())
        return d

    hs.api("routes/restore_step_bool", "step",
           lambda: ns().restore(saved(), model=F.model(), step=True))
    hs.api("routes/checkpointer_save_extra_set", "extra",
           lambda: ns().Checkpointer(F.dir("routes_ck2"), async_save=False).save(
               1, model=F.model(), extra={"a": {1, 2}}))
    hs.api("routes/checkpointer_restore_step_missing", ("step 9", "step"),
           lambda: ns().Checkpointer(saved()).restore(model=F.model(), step=9))

    def stage_report(**kw: Any) -> Any:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        cfg = ns().models.ReferenceConfig(layers=4, scan_layers=True)
        model = nnx.eval_shape(lambda: ns().models.Decoder(cfg, rngs=nnx.Rngs(0)))
        args = {"carry": jax.ShapeDtypeStruct((8, 16, cfg.embed), jnp.float32),
                "microbatches": 4, **kw}
        return ns().pipeline.stage_report(model, "stage=4,data=2", "pp", **args)

    hs.api("routes/stage_report_microbatches_nan", "microbatches",
           lambda: stage_report(microbatches=float("nan")))
    hs.api("routes/stage_report_carry_none", "carry", lambda: stage_report(carry=None))
    hs.api("routes/stage_report_carry_str", "carry", lambda: stage_report(carry="x"))

    def trainer(**kw: Any) -> Any:
        import jax.numpy as jnp
        import optax
        from flax import nnx

        model = F.model()
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        return ns().Trainer(model, opt, lambda m, b: jnp.mean(m(b["x"])), mesh="data=8",
                            rules={"batch": "data"}, **kw)

    hs.api("routes/trainer_unroll_float", ("Trainer", "unroll"), lambda: trainer(unroll=1.5))
    hs.api("routes/trainer_microbatches_str", ("Trainer", "microbatches"),
           lambda: trainer(microbatches="2"))
    hs.api("routes/multistep_unroll_nan", ("multistep", "unroll"),
           lambda: ns().multistep(lambda m, o, b: None, unroll=float("nan")))
