"""One path per task: the free functions take a strategy wherever they take rules, with
the strategy's checks and optimizer-state rules."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard._errors import UsageError

INIT = ns.with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(16, 32, kernel_init=INIT, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(32, 1, use_bias=False, rngs=rngs,
                               kernel_init=ns.with_logical(nnx.initializers.lecun_normal(),
                                                           ("mlp", None)))

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def factory():
    return Net(nnx.Rngs(0))


def spec(x):
    return x.get_value().sharding.spec


def test_zero1_optimizer_state_is_sharded_by_every_spelling():
    zero1 = ns.strategies.get("zero1")
    model = ns.sharded_init(factory, "data=8", zero1)
    assert spec(model.up.kernel) == P(None, None)  # parameters replicated
    for layout in ({"rules": zero1},  # the strategy, or its two tables
                   {"rules": zero1.rules, "opt_rules": zero1.opt_rules}):
        opt = ns.sharded_optimizer(model, optax.adam(1e-3), "data=8", **layout)
        state = opt.opt_state[0]
        assert spec(state.mu["up"]["kernel"]) == P("data", None)
        assert spec(state.nu["up"]["kernel"]) == P("data", None)
    # the rules table alone is a plain table: it carries no optimizer-state rules
    assert type(zero1.rules) is ns.Rules and zero1.rules == ns.Rules(zero1.rules)
    opt = ns.sharded_optimizer(model, optax.adam(1e-3), "data=8", zero1.rules)
    assert spec(opt.opt_state[0].mu["up"]["kernel"]) == P(None, None)
    report = ns.explain(model, "data=8", zero1.rules, optax.adam(1e-3),
                        opt_rules=zero1.opt_rules)
    assert report == ns.explain(model, "data=8", zero1, optax.adam(1e-3))
    with pytest.raises(ns.ShardingError, match="opt_rules= given together with strategy 'zero1'"):
        ns.sharded_optimizer(model, optax.adam(1e-3), "data=8", zero1, opt_rules=zero1.rules)


def test_sharded_and_abstract_init_raise_the_same_check():
    tp = ns.strategies.get("tp")
    errors = []
    for call in (lambda: ns.sharded_init(factory, "data=8", tp),
                 lambda: ns.abstract_init(factory, "data=8", tp)):
        with pytest.raises(ns.ShardingError) as e:
            call()
        errors.append(str(e.value))
    assert "the mesh has no axis 'model'" in errors[0]
    assert len(set(errors)) == 1


def _train(**layout):
    fsdp = ns.strategies.get("fsdp")
    model = ns.sharded_init(factory, "data=8", fsdp)
    opt = ns.sharded_optimizer(model, optax.sgd(0.1), "data=8", fsdp)
    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)  # noqa: E731
    trainer = ns.Trainer(model, opt, loss, steps_per_call=2, **layout)
    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(8, 16)).astype(np.float32),
             "y": rng.normal(size=(8, 1)).astype(np.float32)} for _ in range(4)]
    history = trainer.fit(iter(data), num_steps=4, progress=False)
    return history["loss"], np.asarray(model.up.kernel.get_value())


def test_trainer_takes_a_strategy_and_trains_as_mesh_plus_rules():
    fsdp = ns.strategies.get("fsdp")
    loss_a, kernel_a = _train(mesh="data=8", rules=fsdp.rules)
    loss_b, kernel_b = _train(rules=fsdp)  # the mesh is the model's
    _, kernel_c = _train(mesh="data=8", rules=fsdp)
    np.testing.assert_array_equal(loss_a, loss_b)
    np.testing.assert_array_equal(kernel_a, kernel_b)
    np.testing.assert_array_equal(kernel_a, kernel_c)


def test_trainer_wants_rules_a_table_or_a_strategy():
    fsdp = ns.strategies.get("fsdp")
    model = ns.sharded_init(factory, "data=8", fsdp)
    opt = ns.sharded_optimizer(model, optax.sgd(0.1), "data=8", fsdp)
    loss = lambda m, b: jnp.mean(m(b["x"]))  # noqa: E731
    with pytest.raises(UsageError, match=r"rules= not given\. Fix: pass what ns.sharded_init"):
        ns.Trainer(model, opt, loss, mesh="data=8")
    with pytest.raises(ns.ShardingError, match="strategy 'tp'.*no axis 'model'"):
        ns.Trainer(model, opt, loss, rules=ns.strategies.get("tp"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'strategy'"):
        ns.Trainer(model, opt, loss, strategy=fsdp)  # type: ignore[call-arg]
