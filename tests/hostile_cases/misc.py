"""Hostile cases across surfaces: Precision's dtypes, generate's sampling arguments and
prompts, plan --auto's device counts, explain's strategy and factory, launch's
devices per process, and training a model with an integer parameter."""

from __future__ import annotations

import sys
from typing import Any


def _ns() -> Any:
    import nnx_shard

    return nnx_shard


def _jnp() -> Any:
    import jax.numpy

    return jax.numpy


def build(hs: Any) -> None:
    # -- Precision: None is not a dtype (it read as float64), float8 is no dtype to train in
    for field in ("params", "compute"):
        hs.api(f"misc/precision_{field}_none", field,
               lambda field=field: _ns().Precision(**{field: None}))
        hs.api(f"misc/precision_{field}_float8", field,
               lambda field=field: _ns().Precision(**{field: _jnp().float8_e4m3fn}))
        hs.api(f"misc/precision_{field}_int8", field,
               lambda field=field: _ns().Precision(**{field: "int8"}))

    # -- generate: bools are no temperature or seed; a seed is an int; ids and top_k fit
    # the vocabulary of a model of the caller's (no cfg.vocab: decode's logits say it)
    def tiny() -> Any:
        from flax import nnx

        from nnx_shard.models import Decoder, get_config

        return Decoder(get_config("tiny"), rngs=nnx.Rngs(0))

    def gen(model: Any = None, prompt: Any = ((1, 2, 3),), **kw: Any) -> Any:
        from nnx_shard.inference import generate

        config, rest = hs.generation_config(2, kw)
        return generate(tiny() if model is None else model, prompt, config, **rest)

    hs.api("misc/generate_temperature_bool", "temperature", lambda: gen(temperature=True))
    for label, seed in (("bool", True), ("float", 1.5), ("text", "abc"), ("none", None),
                        ("huge", 2**70), ("key_array", "KEY")):
        hs.api(f"misc/generate_seed_{label}", "seed", lambda seed=seed: gen(
            temperature=1.0, seed=_key() if seed == "KEY" else seed))

    def sampler(**kw: Any) -> Any:
        from nnx_shard.inference._sampling import generate as window_sample

        args = {"temperature": 1.0, "seed": 0, **kw}
        return window_sample(tiny(), [1, 2, 3], 2, args["temperature"], args["seed"])

    hs.api("misc/sampler_temperature_bool", "temperature", lambda: sampler(temperature=True))
    hs.api("misc/sampler_seed_bool", "seed", lambda: sampler(seed=True))
    for label, prompt in (("id_at_vocab", ((1, 64, 3),)), ("id_negative", ((1, 2, -1),))):
        hs.api(f"misc/generate_custom_{label}", ("prompt_tokens", "vocabulary"),
               lambda prompt=prompt: gen(_stock_lm(), prompt))
    hs.api("misc/generate_custom_top_k_negative", "top_k",
           lambda: gen(_stock_lm(), temperature=1.0, top_k=-1))

    # -- plan --auto: no layout whose devices would all repeat one step; a bounded count
    auto = ("plan", "--auto", "--model", "tiny", "--batch", "8", "--seq", "16", "--no-cache")
    hs.cli("misc/plan_auto_three_devices_dense", ("devices", "no preset can use 3"),
           *auto, "--devices", "3")
    hs.cli("misc/plan_auto_devices_billion", "--devices", *auto, "--devices", "1000000000")
    hs.api("misc/auto_devices_billion", "devices", lambda: _ns().planner.auto(
        "tiny", devices=10**9, batch=8, seq=16, progress=False))

    # -- explain: --strategy is known and not given with --rules; a factory that ends the
    # process itself, or a file that is not Python, is an error naming the factory
    def explain(*argv: str) -> Any:
        factory = hs.F.file("misc_factory.py", "from flax import nnx\ndef make():\n"
                                               "    return nnx.Linear(4, 8, rngs=nnx.Rngs(0))\n")
        rules = hs.F.file("misc_rules.json", '{"batch": "data"}')
        subst = {"FACTORY": f"{factory}:make", "RULES": rules,
                 "TXT": hs.F.file("misc_factory.txt", "def make(): pass\n") + ":make"}
        return hs._run_cli(["explain", *(subst.get(a, a) for a in argv)])

    hs.api("misc/explain_rules_and_unknown_strategy", "--strategy", lambda: explain(
        "FACTORY", "--mesh", "data=8", "--rules", "RULES", "--strategy", "bogus"))
    hs.api("misc/explain_rules_and_strategy", ("--rules", "--strategy"), lambda: explain(
        "FACTORY", "--mesh", "data=8", "--rules", "RULES", "--strategy", "fsdp"))
    hs.api("misc/explain_unknown_strategy", "--strategy", lambda: explain(
        "FACTORY", "--mesh", "data=8", "--strategy", "bogus"))
    hs.api("misc/explain_factory_not_py", "not a .py file", lambda: explain(
        "TXT", "--mesh", "data=8", "--strategy", "dp"))
    for label, source in (("factory", "import os\ndef make():\n    os._exit(0)\n"),
                          ("module", "import os\nos._exit(0)\n")):
        hs.api(f"misc/explain_os_exit_in_{label}", ("FACTORY", "os._exit"),
               lambda label=label, source=source: _console(
                   "explain", hs.F.file(f"misc_exit_{label}.py", source) + ":make",
                   "--mesh", "data=8", "--strategy", "dp"), slow=True)

    # -- launch: a bounded number of devices per process (100,000 grew each to gigabytes)
    hs.cli("misc/launch_devices_per_process_huge", "--devices-per-process", "launch", "-n", "2",
           "--devices-per-process", "100000", "--", sys.executable, "-c", "pass")

    # -- an integer nnx.Param tracked by the optimizer: jax.grad failed inside fit
    hs.api("misc/trainer_integer_param", ("integer parameter", "seen"), _int_param_fit)


def _int_param_fit() -> Any:
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    class Counted(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.lin = nnx.Linear(2, 1, rngs=rngs)
            self.seen = nnx.Param(jnp.array(0, jnp.int32))

        def __call__(self, x: Any) -> Any:
            return self.lin(x)

    model = Counted(nnx.Rngs(0))
    trainer = _ns().Trainer(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
                            lambda m, b: jnp.mean((m(b) - 1.0) ** 2), mesh="data=8",
                            rules={"batch": "data"}, steps_per_call=2)
    return trainer.fit([np.ones((8, 2), np.float32)] * 2, 2, progress=False)


def _console(*argv: str) -> Any:
    """The console script in a fresh Python (for code that would end the sweep's worker)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "NNX_SHARD_DEBUG"}
    done = subprocess.run([sys.executable, "-m", "nnx_shard.cli", *argv], capture_output=True,
                          text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    return ("cli", done.returncode, done.stdout, done.stderr)


def _key() -> Any:
    import jax

    return jax.random.key(0)


def _stock_lm() -> Any:
    """A model of stock Flax layers with no ``cfg``: a vocabulary of 64 that only its logits
    say."""
    import jax.numpy as jnp
    from flax import nnx

    from nnx_shard.inference import CACHE_AXES

    class StockLM(nnx.Module):
        max_length = 16

        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(64, 16, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(2, 16, decode=False, rngs=rngs)
            self.out = nnx.Linear(16, 64, rngs=rngs)

        def init_cache(self, batch: int, length: int) -> None:
            self.attn.init_cache((batch, length, 16))
            _ns().annotate(self, {r"attn/cached_(key|value)$": CACHE_AXES})

        def decode(self, tokens: Any) -> Any:
            steps = [self.out(self.attn(self.embed(tokens[:, t:t + 1]), decode=True))
                     for t in range(tokens.shape[1])]
            return jnp.concatenate(steps, axis=1)

    return StockLM(nnx.Rngs(0))
