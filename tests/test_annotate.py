import jax
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_shard as ns

lecun = nnx.initializers.lecun_normal()


def test_with_logical_stores_flax_metadata_and_builds_without_mesh():
    layer = nnx.Linear(4, 8, kernel_init=ns.with_logical(lecun, ("embed", "mlp")), rngs=nnx.Rngs(0))
    assert layer.kernel.get_metadata("out_sharding") == ("embed", "mlp")
    # Flax's own reader sees the same names
    assert nnx.get_partition_spec(nnx.state(layer))["kernel"].get_value() == jax.P("embed", "mlp")
    # an optimizer copies the metadata; must not try to shard logical names eagerly
    opt = nnx.Optimizer(layer, optax.adam(1e-3), wrt=nnx.Param)
    assert opt.opt_state[0].mu["kernel"].get_metadata("out_sharding") == ("embed", "mlp")


def test_with_logical_rejects_bad_names_and_misspelled_keys():
    with pytest.raises(ns.ShardingError, match="entry 1 is 2"):
        ns.with_logical(lecun, ("embed", 2))
    with pytest.raises(ns.ShardingError, match="misspelling of 'out_sharding'"):
        ns.with_logical(lecun, ("embed", "mlp"), out_shardings=("a",))


def test_misspelled_metadata_on_model_is_reported_with_path():
    m = nnx.Linear(4, 8, kernel_metadata={"out_shardings": ("embed", "mlp")}, rngs=nnx.Rngs(0))
    with pytest.raises(ns.ShardingError, match="'kernel'.*'out_shardings'"):
        ns.get_logical_axes(m)


def test_class_decorator():
    @ns.logical_axes(kernel=("embed", "mlp"), bias=("mlp",))
    class Up(nnx.Linear):
        pass

    up = Up(4, 8, rngs=nnx.Rngs(0))
    assert up.kernel.get_metadata("out_sharding") == ("embed", "mlp")
    assert up.bias.get_metadata("out_sharding") == ("mlp",)
    assert Up(4, 8, use_bias=False, rngs=nnx.Rngs(0)).bias is None
    axes = ns.get_logical_axes(up)
    assert axes["kernel"] == ("embed", "mlp")


def test_class_decorator_errors():
    @ns.logical_axes(kernal=("embed", "mlp"))
    class Typo(nnx.Linear):
        pass

    with pytest.raises(ns.ShardingError, match="Did you mean 'kernel'"):
        Typo(4, 8, rngs=nnx.Rngs(0))

    @ns.logical_axes(kernel=("embed",))
    class WrongRank(nnx.Linear):
        pass

    with pytest.raises(ns.ShardingError, match=r"WrongRank.kernel \(shape \(4, 8\)"):
        WrongRank(4, 8, rngs=nnx.Rngs(0))


def seed_model():
    return nnx.Sequential(nnx.Linear(20, 30, rngs=nnx.Rngs(0)), nnx.Linear(30, 1, rngs=nnx.Rngs(1)))


def test_annotate_by_pattern_first_match_wins():
    m = seed_model()
    ns.annotate(m, {r"layers/0/kernel": ("embed", "mlp"), r"kernel$": ("mlp", None)})
    axes = ns.get_logical_axes(m)
    assert axes["layers"][0]["kernel"] == ("embed", "mlp")
    assert axes["layers"][1]["kernel"] == ("mlp", None)
    assert axes["layers"][0]["bias"] is None
    assert m.layers[0].kernel.get_metadata("logical_source") == "pattern"
    # values unchanged
    assert m.layers[0].kernel.shape == (20, 30)


def test_annotate_strict_lists_everything_missing():
    with pytest.raises(ns.ShardingError) as e:
        ns.annotate(seed_model(), {r"kernel$": ("embed", "mlp"), r"nothing": ("x",)}, strict=True)
    msg = str(e.value)
    assert "layers/0/bias (30,)" in msg and "layers/1/bias (1,)" in msg and "'nothing'" in msg


def test_annotate_rank_check_names_path_and_pattern():
    with pytest.raises(ns.ShardingError, match=r"'layers/0/bias' matched by pattern 'bias'"):
        ns.annotate(seed_model(), {"bias": ("embed", "mlp")})


def test_annotate_takes_a_module_not_a_factory():
    with pytest.raises(ns.UsageError, match=r"model must be an nnx.Module .* got a function .*"
                       r"ns.sharded_init\(lambda: ns.annotate\(MyModel.*nnx.eval_shape"):
        ns.annotate(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)), {r"kernel$": ("embed", "mlp")})
    with pytest.raises(ns.UsageError, match="got dict"):
        ns.annotate({"kernel": 1}, {r"kernel$": ("embed", "mlp")})
    # What the message suggests works: an abstract module, and annotate inside the factory.
    pats = {r"kernel$": ("embed", "mlp"), r"bias$": ("mlp",)}
    abstract = ns.annotate(nnx.eval_shape(lambda: nnx.Linear(2, 4, rngs=nnx.Rngs(0))), pats,
                           strict=True)
    assert abstract.kernel.get_metadata("out_sharding") == ("embed", "mlp")
    model = ns.sharded_init(lambda: ns.annotate(nnx.Linear(2, 4, rngs=nnx.Rngs(0)), pats),
                            "data=4,model=2", {"embed": None, "mlp": "model"})
    assert model.kernel.get_value().sharding.spec == P(None, "model")


def test_annotate_guide_runs_as_written(capsys):
    # The guide's blocks, run in order: the MLP example trains (its rules map
    # both batch and embed to data, which only works if activations do not name
    # embed), and a stock-layer model is annotated inside its factory.
    import re
    from pathlib import Path

    guide = Path(__file__).resolve().parent.parent / "docs" / "guides" / "annotate.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    assert len(blocks) == 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/guides/annotate.md", "exec"), namespace)
    history = namespace["history"]
    assert len(history) == 10 and history["loss"][-1] < history["loss"][0]
    assert namespace["net"].mlp.kernel.get_value().sharding.spec == P("data", "model")
    assert namespace["logits"].shape == (8, 16, 64)
    assert "P('data', 'model')" in capsys.readouterr().out


def test_wrong_types_are_named():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ns.ShardingError, match=r"annotate: patterns must be a dict .* got int"):
        ns.annotate(model, 5)
    with pytest.raises(ns.UsageError, match=r"get_logical_axes: tree must be an nnx.Module or "
                                         r"nnx.State, got int"):
        ns.get_logical_axes(5)
    with ns.use("data=8", {"batch": "data"}):
        with pytest.raises(ns.UsageError, match=r"constrain: x must be an array, got str"):
            ns.constrain("x", ("batch",))
