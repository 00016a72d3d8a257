import optax
import pytest
from flax import nnx

import nnx_shard as ns
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
