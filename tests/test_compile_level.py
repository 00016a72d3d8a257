"""The test processes compile at XLA's lowest backend optimisation level (tests/conftest.py).

That is only sound if the level changes nothing the tests assert: the optimised HLO (where the
shardings and collectives are), XLA's per-device memory figures and, within float rounding,
the numbers. Here one sharded training step is compiled in this process and in a fresh one at
XLA's default level, and the three are compared.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

LEVEL = "--xla_backend_optimization_level"


def figures() -> dict[str, Any]:
    """Compile one fsdp_tp training step of the tiny transformer; its HLO hash, memory, loss."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import _transformer as T

    mesh = ns.make_mesh({"data": 4, "model": 2})
    strategy = ns.strategies.get("fsdp_tp")
    cfg = ns.models.get_config("tiny")
    model = ns.sharded_init(lambda: T.Transformer(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
    opt = ns.sharded_optimizer(model, optax.adam(1e-3), mesh, strategy)

    @nnx.jit
    def step(model: Any, opt: Any, batch: dict[str, Any]) -> Any:
        loss, grads = nnx.value_and_grad(T.lm_loss)(model, batch)
        opt.update(model, grads)
        return loss

    tokens = (jnp.arange(8 * 17, dtype=jnp.int32).reshape(8, 17) * 7) % cfg.vocab
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    compiled = step.lower(model, opt, batch).compile()
    memory = compiled.memory_analysis()
    # Source locations differ between the two processes' call sites; the program does not.
    hlo = re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n.*?(?=\n\n)", "",
                 compiled.as_text(), flags=re.S)
    hlo = re.sub(r"metadata=\{[^}]*\}", "", hlo)
    return {
        "hlo": hashlib.sha256(hlo.encode()).hexdigest(),
        "collectives": len(re.findall(r"all-reduce|all-gather|reduce-scatter|all-to-all", hlo)),
        "memory": [memory.argument_size_in_bytes, memory.output_size_in_bytes,
                   memory.temp_size_in_bytes, memory.alias_size_in_bytes],
        "losses": [float(step(model, opt, batch)) for _ in range(3)],
    }


@pytest.mark.slow
def test_lowest_level_keeps_the_hlo_memory_and_numbers_of_the_default_level() -> None:
    assert f"{LEVEL}=0" in os.environ["XLA_FLAGS"]
    here = figures()
    flags = " ".join(f for f in os.environ["XLA_FLAGS"].split() if not f.startswith(LEVEL))
    env = {**os.environ, "XLA_FLAGS": flags}
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=600, check=True)
    default = json.loads(out.stdout.strip().splitlines()[-1])
    assert here["collectives"] > 0
    assert here["hlo"] == default["hlo"]
    assert here["collectives"] == default["collectives"]
    assert here["memory"] == default["memory"]
    losses, ref = np.array(here["losses"]), np.array(default["losses"])
    assert not np.array_equal(ref[0], ref[-1])  # the steps train, so the comparison has teeth
    np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


if __name__ == "__main__":
    print(json.dumps(figures()))
