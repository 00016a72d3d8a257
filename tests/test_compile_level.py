"""The test processes compile with flags that make XLA's CPU code generation cheaper
(tests/conftest.py's COMPILE_SPEED_FLAGS: the lowest backend optimisation level, one
code-generation thread and, on jaxlib <= 0.11.0 whose XLA still has it, the older fusion
emitter).

That is only sound if the flags change nothing the tests assert: the collectives and layouts of
the optimised program, XLA's per-device memory figures (the older emitter fuses a few reductions
differently, so temporaries may move slightly) and, within float rounding, the numbers. Here one
sharded training step is compiled in this process and in a fresh one with XLA's default flags,
and the two are compared.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest


def figures() -> dict[str, Any]:
    """Compile one fsdp_tp training step of the tiny transformer; its collectives, layouts,
    memory and losses."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import Decoder, lm_loss

    mesh = ns.make_mesh({"data": 4, "model": 2})
    strategy = ns.strategies.get("fsdp_tp")
    cfg = ns.models.get_config("tiny")
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
    opt = ns.sharded_optimizer(model, optax.adam(1e-3), mesh, strategy)

    @nnx.jit
    def step(model: Any, opt: Any, batch: dict[str, Any]) -> Any:
        loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
        opt.update(model, grads)
        return loss

    tokens = (jnp.arange(8 * 17, dtype=jnp.int32).reshape(8, 17) * 7) % cfg.vocab
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    compiled = step.lower(model, opt, batch).compile()
    memory = compiled.memory_analysis()
    # Instruction names and source locations differ between processes and fusion choices; the
    # collectives (kind, shape, device groups) and the arguments' and outputs' layouts do not.
    hlo = re.sub(r"metadata=\{[^}]*\}", "", compiled.as_text())
    collectives = sorted(
        re.sub(r"^\s*(ROOT )?%\S+ = ", "", re.sub(r"%[\w.-]+", "%", line)).strip()
        for line in hlo.splitlines()
        if re.search(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all)(-start)?\(", line))
    return {
        "collectives": collectives,
        "shardings": [str(s) for s in jax.tree.leaves(
            (compiled.input_shardings, compiled.output_shardings))],
        "memory": {"argument": memory.argument_size_in_bytes,
                   "output": memory.output_size_in_bytes, "temp": memory.temp_size_in_bytes,
                   "alias": memory.alias_size_in_bytes},
        "losses": [float(step(model, opt, batch)) for _ in range(3)],
    }


@pytest.mark.slow
def test_compile_speed_flags_keep_the_collectives_memory_and_numbers_of_the_defaults() -> None:
    # Imported here: the child runs this file as a script and must not set the flags.
    from tests.conftest import COMPILE_SPEED_FLAGS

    names = [flag.split("=")[0] for flag in COMPILE_SPEED_FLAGS]
    assert all(flag in os.environ["XLA_FLAGS"].split() for flag in COMPILE_SPEED_FLAGS)
    here = figures()
    flags = " ".join(f for f in os.environ["XLA_FLAGS"].split() if f.split("=")[0] not in names)
    env = {**os.environ, "XLA_FLAGS": flags}
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=600, check=True)
    default = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(here["collectives"]) > 0
    assert here["collectives"] == default["collectives"]
    assert here["shardings"] == default["shardings"]
    # The older fusion emitter (jaxlib <= 0.11.0) fuses a few reductions differently: the
    # temporaries may move by a few hundred bytes of the step's ~400 KB, never the arguments,
    # outputs or donations.
    temp, default_temp = here["memory"].pop("temp"), default["memory"].pop("temp")
    assert here["memory"] == default["memory"]
    assert abs(temp - default_temp) <= 0.01 * default_temp
    losses, ref = np.array(here["losses"]), np.array(default["losses"])
    assert not np.array_equal(ref[0], ref[-1])  # the steps train, so the comparison has teeth
    np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


if __name__ == "__main__":
    print(json.dumps(figures()))
