"""Quickstart: annotate a model with logical axes, pick rules, see and apply the layout.

Run: python examples/quickstart.py   (simulates 8 CPU devices when only one exists)
"""

import os

# Simulated devices must be requested before jax is imported.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax
import optax
from flax import nnx

import nnx_shard as ns

lecun = nnx.initializers.lecun_normal()


@ns.logical_axes(kernel=("embed", "mlp"), bias=("mlp",))
class Up(nnx.Linear):
    pass


class MLP(nnx.Module):
    def __init__(self, d: int, h: int, rngs: nnx.Rngs):
        self.up = Up(d, h, rngs=rngs)
        self.down = nnx.Linear(h, d, kernel_init=ns.with_logical(lecun, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        x = ns.constrain(x, ("batch", "embed"))
        return self.down(jax.nn.relu(self.up(x)))


def main() -> None:
    mesh = ns.make_mesh({"data": -1, "model": 2} if jax.device_count() % 2 == 0 else {"data": -1})
    rules = ns.Rules({"batch": "data", "embed": "data", "mlp": ns.Fallbacks("model", None)})
    print(rules, "\n")

    abstract = nnx.eval_shape(lambda: MLP(256, 1024, nnx.Rngs(0)))
    print(ns.explain(abstract, mesh, rules, optimizer=optax.adam(1e-3)), "\n")

    model = MLP(256, 1024, nnx.Rngs(0))
    state = jax.jit(lambda s: s, out_shardings=ns.shardings(model, mesh, rules))(nnx.state(model))
    nnx.update(model, state)
    print("up.kernel is laid out as", model.up.kernel.get_value().sharding.spec)

    try:
        ns.Rules({"batch": "data", "embed": "data", "mpl": "model"}).spec(
            ("embed", "mlp"), shape=(256, 1024), mesh=mesh, path="up/kernel"
        )
    except ns.ShardingError as e:
        print("\nA typo in the rules is caught with a fix:\n ", e)


if __name__ == "__main__":
    main()
