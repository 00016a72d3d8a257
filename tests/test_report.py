import jax
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard._annotate import path_str
from tests.conftest import needs_devices

lecun = nnx.initializers.lecun_normal()


def mlp():
    m = nnx.Sequential(
        nnx.Linear(64, 128, kernel_init=ns.with_logical(lecun, ("embed", "mlp")), rngs=nnx.Rngs(0)),
        nnx.Linear(128, 64, rngs=nnx.Rngs(1)),
    )
    return ns.annotate(m, {r"layers/1/kernel": ("mlp", "embed")})


@needs_devices(8)
def test_explain_rows_bytes_and_sources_on_abstract_model():
    abstract = nnx.eval_shape(mlp)
    rules = ns.Rules({"embed": "data", "mlp": "model"})
    r = ns.explain(abstract, "data=4,model=2", rules, optimizer=optax.adam(1e-3))
    rows = {row.path: row for row in r.rows}
    k0 = rows["layers/0/kernel"]
    assert k0.total_bytes == 64 * 128 * 4 and k0.bytes_per_device == 64 * 128 * 4 // 8
    assert k0.source == "annotation" and rows["layers/1/kernel"].source == "pattern"
    assert rows["layers/0/bias"].source == "default (replicated)"
    params = 2 * 64 * 128 * 4 + (128 + 64) * 4
    assert r.total_bytes == params
    assert r.param_bytes_per_device == 2 * 64 * 128 * 4 // 8 + (128 + 64) * 4
    assert r.opt_total_bytes == 2 * params + 4  # mu, nu, count
    assert r.opt_bytes_per_device == 2 * r.param_bytes_per_device + 4
    assert {x.path for x in r.replicated} >= {"layers/0/bias", "layers/1/bias"}
    text = str(r)
    assert "layers/0/kernel" in text and "P('data', 'model')" in text
    assert "default (replicated)" in text and "optimizer state:" in text
    md = r.to_markdown()
    assert md.startswith("| path |") and "| layers/1/kernel | (128, 64) |" in md


@needs_devices(8)
def test_explain_zero1_opt_rules():
    r = ns.explain(nnx.eval_shape(mlp), "data=8", ns.Rules({"embed": None, "mlp": None}),
                   optimizer=optax.sgd(0.1, momentum=0.9),
                   opt_rules=ns.Rules({"embed": "data", "mlp": None}))
    assert r.param_bytes_per_device == r.total_bytes
    kernel_bytes = 2 * 64 * 128 * 4
    assert r.opt_bytes_per_device == kernel_bytes // 8 + (128 + 64) * 4


@needs_devices(8)
def test_explain_raises_with_path():
    with pytest.raises(ns.ShardingError, match="'layers/0/kernel'"):
        ns.explain(nnx.eval_shape(mlp), "data=8", ns.Rules({"embed": "data"}))


@needs_devices(8)
def test_explain_counts_batch_stats_and_rng_keys():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

    r = ns.explain(M(nnx.Rngs(0)), "data=8", ns.Rules({}))
    rows = {row.path: row for row in r.rows}
    assert rows["drop/rngs/key"].total_bytes == 8 and rows["drop/rngs/key"].dtype == "key<fry>"
    assert rows["bn/mean"].kind == "BatchStat"
    assert r.total_bytes == 4 * 16 + 4 + 8 + 64 + 16 == r.param_bytes_per_device
    assert "model variables: 156 B total, 156 B per device" in str(r)


class TwoLayers(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(32, 64, kernel_init=ns.with_logical(lecun, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(64, 32, kernel_init=ns.with_logical(lecun, ("mlp", "embed")),
                               rngs=rngs)
        # Square: which dimension a factored statistic kept is ambiguous (replicated).
        self.sq = nnx.Linear(32, 32, kernel_init=ns.with_logical(lecun, ("embed", "mlp")),
                             use_bias=False, rngs=rngs)


def _labels(params):
    return jax.tree.map(lambda p: "matrix" if p.ndim == 2 else "vector", params)


TRANSFORMS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
    "adafactor_factored": lambda: optax.adafactor(1e-3, min_dim_size_to_factor=32),
    "adafactor_unfactored": lambda: optax.adafactor(1e-3, factored=False),
    "lion": lambda: optax.lion(1e-4),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "chain_clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    "multi_transform": lambda: optax.multi_transform(
        {"matrix": optax.adam(1e-3), "vector": optax.sgd(1e-2, momentum=0.9)}, _labels),
}


@needs_devices(8)
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_sharded_optimizer_and_explain_agree_on_optimizer_state(name):
    """Both views take each state leaf's layout from one function: the bytes explain
    promises per device are the bytes of the shards sharded_optimizer builds."""
    mesh = ns.make_mesh("data=4,model=2")
    rules = ns.Rules({"embed": "data", "mlp": "model"})
    model = ns.sharded_init(lambda: TwoLayers(nnx.Rngs(0)), mesh, rules)
    tx = TRANSFORMS[name]()
    opt = ns.sharded_optimizer(model, tx, mesh, rules)
    report = ns.explain(model, mesh, rules, optimizer=tx)
    leaves = jax.tree.leaves(opt.opt_state)
    assert leaves
    actual = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    assert report.opt_bytes_per_device == actual
    assert report.opt_total_bytes == sum(x.nbytes for x in leaves)
    # Row by row: the spec explain reports is the one the array has.
    rows = {r.path: r for r in report.rows if r.group == "optimizer"}
    flat = nnx.to_flat_state(nnx.state(opt, nnx.optimizer.OptState))
    arrays = {path_str(p): v.get_value() for p, v in flat if hasattr(v.get_value(), "sharding")}
    arrays.pop("step", None)  # the Optimizer's own counter, not optax's state
    assert set(arrays) == set(rows)
    for path, x in arrays.items():
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, rows[path].spec), x.ndim), path
    # And explain on the abstract model says the same.
    abstract = ns.abstract_init(lambda: TwoLayers(nnx.Rngs(0)), mesh, rules)
    assert ns.explain(abstract, mesh, rules, optimizer=tx).opt_bytes_per_device == actual


@needs_devices(8)
def test_factored_statistics_keep_the_names_of_the_dims_they_kept():
    mesh = ns.make_mesh("data=4,model=2")
    rules = ns.Rules({"embed": "data", "mlp": "model"})
    abstract = ns.abstract_init(lambda: TwoLayers(nnx.Rngs(0)), mesh, rules)
    tx = optax.adafactor(1e-3, min_dim_size_to_factor=32)
    rows = {r.path: r for r in ns.explain(abstract, mesh, rules, optimizer=tx).rows}
    row, col = rows["opt_state/0/v_row/up/kernel"], rows["opt_state/0/v_col/up/kernel"]
    assert (row.shape, row.names, row.spec) == ((32,), ("embed",), P("data"))
    assert (col.shape, col.names, col.spec) == ((64,), ("mlp",), P("model"))
    assert row.source == "parameter's kept dims"
    # (32, 32): both statistics have shape (32,); which dim each kept is ambiguous.
    assert rows["opt_state/0/v_row/sq/kernel"].spec == P()
    assert rows["opt_state/0/v_row/sq/kernel"].source == "default (replicated)"
    opt = ns.sharded_optimizer(abstract, tx, mesh, rules)
    assert opt.opt_state[0].v_row["up"]["kernel"].get_value().sharding.spec == P("data")


@needs_devices(8)
@pytest.mark.parametrize("model", [5, "model", None])
def test_explain_rejects_what_is_not_a_model(model):
    with pytest.raises(ns.UsageError, match=r"explain: model must be an nnx.Module.*got "
                       rf"{type(model).__name__}.*Fix: .*nnx.eval_shape"):
        ns.explain(model, "data=8", ns.Rules({}))


@needs_devices(8)
@pytest.mark.parametrize("optimizer", ["adam", 1e-3, optax.adam])
def test_explain_rejects_what_is_not_an_optax_transformation(optimizer):
    with pytest.raises(ns.UsageError, match=r"explain: optimizer must be an "
                       r"optax.GradientTransformation, got .*optimizer=optax.adam\(1e-3\)"):
        ns.explain(nnx.eval_shape(mlp), "data=8", ns.Rules({}), optimizer=optimizer)
