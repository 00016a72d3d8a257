import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard import _mesh as ns_mesh
from nnx_shard._mesh import current
from nnx_shard._rules import Rules
from tests.conftest import needs_devices

lecun = nnx.initializers.lecun_normal()
RULES = ns.Rules({"layers": None, "embed": "data", "mlp": "model", "batch": "data"})


@needs_devices(8)
def test_make_mesh_forms():
    assert dict(ns.make_mesh("data=4,model=2").shape) == {"data": 4, "model": 2}
    assert dict(ns.make_mesh({"data": -1, "model": 2}).shape) == {"data": 4, "model": 2}
    m = ns.make_mesh("data=8", axis_types="auto")
    assert m.axis_types == (AxisType.Auto,)
    assert ns.make_mesh(m) is m


@needs_devices(8)
@pytest.mark.parametrize(
    "spec, error, match",
    [("data=3,model=2", ns.ShardingError, "needs 6 devices but 8"),
     ("data", ns.UsageError, "not 'axis=size'"), ("data=x", ns.UsageError, "not an integer"),
     ("data=-1,model=-1", ns.UsageError, "only one axis"), ("data=0", ns.UsageError, "size 0")],
)
def test_make_mesh_errors(spec, error, match):
    with pytest.raises(error, match=match):
        ns.make_mesh(spec)


@pytest.mark.parametrize("spec, want", [
    ("data=4,model=2", {"data": 4, "model": 2}),
    ("model=2,data=4", {"model": 2, "data": 4}),
    (" data = 4 , , model=-1 ", {"data": 4, "model": -1}),
    ({"data": 2, "model": -1}, {"data": 2, "model": -1}),
])
def test_parse_axes_grammar(spec, want):
    axes = ns_mesh.parse_axes(spec)
    assert axes == want and list(axes) == list(want)  # the order is the mesh's


BAD_MESHES = [
    ("data=4,model", "mesh spec 'data=4,model': 'model' is not 'axis=size'."),
    ("data=four", "mesh spec 'data=four': size 'four' of axis 'data' is not an integer."),
    ("data=2,data=4", "mesh spec 'data=2,data=4': axis 'data' appears twice."),
    ("data=0", "mesh spec 'data=0': axis 'data' has size 0;"),
    ("data=-1,model=-1", "mesh spec 'data=-1,model=-1': only one axis may have size -1"),
    (",", "mesh spec ',' names no axes."),
]


@needs_devices(8)
@pytest.mark.parametrize("spec, core", BAD_MESHES)
def test_a_bad_mesh_string_reads_the_same_everywhere(spec, core, capsys):
    from nnx_shard import cli, planner

    def message(call):
        with pytest.raises(ns.UsageError) as e:
            call()
        return str(e.value)

    by_make_mesh = message(lambda: ns.make_mesh(spec))
    by_planner = message(lambda: planner.compiled_memory("tiny", spec, "dp"))
    assert by_make_mesh.startswith(core) and by_planner == by_make_mesh
    assert cli.main(["plan", "--model", "tiny", "--mesh", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"nnx-shard: error: --mesh: {by_make_mesh}"


def test_a_rest_axis_needs_devices_to_count():
    with pytest.raises(ns.UsageError, match=r"'data=-1': every axis needs a size here.*'data=8'"):
        ns_mesh.parse_axes("data=-1", rest=False)
    assert ns_mesh.parse_axes("data=-1") == {"data": -1}


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 16, kernel_init=ns.with_logical(lecun, ("embed", "mlp")),
                              bias_init=ns.with_logical(nnx.initializers.zeros, ("mlp",)), rngs=rngs)


@needs_devices(8)
def test_shardings_tree_usable_as_out_shardings():
    mesh = ns.make_mesh("data=4,model=2")
    model = Block(nnx.Rngs(0))
    sh = ns.shardings(model, mesh, RULES)
    assert sh["lin"]["kernel"].get_value().spec == P("data", "model")
    assert sh["lin"]["bias"].get_value().spec == P("model")
    state = jax.jit(lambda s: s, out_shardings=sh)(nnx.state(model))
    assert state["lin"]["kernel"].get_value().sharding.spec == P("data", "model")
    shard_shapes = {s.data.shape for s in state["lin"]["kernel"].get_value().addressable_shards}
    assert shard_shapes == {(2, 8)}


@needs_devices(8)
def test_stacked_layers_resolve_through_layer_axis_and_optimizer_follows():
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(key):
        return Block(nnx.Rngs(key))

    model = make(jax.random.split(jax.random.key(0), 4))
    mesh = ns.make_mesh("data=4,model=2")
    assert ns.shardings(model, mesh, RULES)["lin"]["kernel"].get_value().spec == P(None, "data", "model")
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    mu = ns.shardings(opt, mesh, RULES)["opt_state"][0]["mu"]["lin"]["kernel"].get_value()
    assert mu.spec == P(None, "data", "model")


@needs_devices(8)
def test_stacked_without_layer_name_raises_with_fix():
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return Block(nnx.Rngs(key))

    model = make(jax.random.split(jax.random.key(0), 4))
    with pytest.raises(ns.ShardingError, match=r"2 variables(.|\n)*'lin/kernel' \(shape \(4, 8, 16\).*PARTITION_NAME"):
        ns.shardings(model, ns.make_mesh("data=4,model=2"), RULES)


@needs_devices(8)
def test_flax_with_partitioning_models_work():
    with nnx.use_eager_sharding(False):
        m = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(lecun, ("embed", "mlp")),
                       rngs=nnx.Rngs(0))
    assert ns.shardings(m, ns.make_mesh("data=4,model=2"), RULES)["kernel"].get_value().spec == P(
        "data", "model"
    )


@needs_devices(8)
def test_error_surfaces_with_path_from_shardings():
    m = Block(nnx.Rngs(0))
    with pytest.raises(ns.ShardingError, match="'lin/bias'(.|\n)*'lin/kernel'.*'tensor'"):
        ns.shardings(m, ns.make_mesh("data=8"), ns.Rules({"embed": "data", "mlp": "tensor"}))


@needs_devices(8)
@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
def test_use_and_constrain(axis_types):
    rules = ns.Rules({"batch": "data", "embed": "model"})
    x = jnp.ones((8, 4))
    with ns.use(ns.make_mesh("data=4,model=2", axis_types=axis_types), rules):
        y = jax.jit(lambda x: ns.constrain(x + 1, ("batch", "embed")))(x)
        assert current()[1] is rules
        with pytest.raises(ns.ShardingError, match="'activation'"):
            ns.constrain(jnp.ones((3, 4)), ("batch", "embed"))
    assert y.sharding.spec == P("data", "model")
    assert current() is None
    assert ns.constrain(x, ("batch", "embed")) is x


@needs_devices(8)
@pytest.mark.parametrize(
    "spec, error, match",
    [
        (None, ns.UsageError, r"spec must be a string 'axis=size,...'.*got NoneType None.*Fix: e.g. "
         r"make_mesh\('data=4,model=2'\)"),
        (8, ns.UsageError, r"got int 8\. Fix: make_mesh\('data=8'\)"),
        ([("data", 8)], ns.UsageError, r"got list \[\('data', 8\)\].*Fix: e.g. make_mesh"),
        ({"data": 8.5}, ns.UsageError, r"size 8.5 of axis 'data' is a float, not an int.*Fix"),
        ({"data": True}, ns.UsageError, r"size True of axis 'data' is a bool, not an int"),
        ({"data": "8"}, ns.UsageError, r"size '8' of axis 'data' is a str"),
    ],
)
def test_make_mesh_rejects_specs_it_would_misread(spec, error, match):
    with pytest.raises(error, match=match):
        ns.make_mesh(spec)


@needs_devices(8)
def test_make_mesh_device_list_errors():
    devs = jax.devices()
    with pytest.raises(ns.ShardingError, match=r"devices=\[\] is empty.*Fix: leave devices out"):
        ns.make_mesh("data=-1", devices=[])
    with pytest.raises(ns.ShardingError, match=r"devices lists cpu:0 more than once \(4 entries, "
                       r"3 distinct devices\).*Fix: pass distinct devices"):
        ns.make_mesh("data=4", devices=[devs[0], devs[1], devs[0], devs[2]])
    with pytest.raises(ns.ShardingError, match=r"devices must be a list of jax devices, got int 4"):
        ns.make_mesh("data=4", devices=4)
    with pytest.raises(ns.ShardingError, match=r"devices must be jax devices, got int 0"):
        ns.make_mesh("data=2", devices=[0, 1])


@needs_devices(8)
def test_mesh_smaller_than_the_devices_names_the_subset_to_pass():
    with pytest.raises(ns.ShardingError, match=r"mesh data=1 needs 1 devices but 8 are "
                       r"available.*devices=jax\.devices\(\)\[:1\]"):
        ns.make_mesh("data=1")
    with pytest.raises(ns.ShardingError, match=r"mesh data=2,model=2 needs 4 devices but 6 are "
                       r"given.*devices=devices\[:4\]"):
        ns.make_mesh("data=2,model=2", devices=jax.devices()[:6])
    assert dict(ns.make_mesh("data=1", devices=jax.devices()[:1]).shape) == {"data": 1}
    with pytest.raises(ns.ShardingError, match=r"needs 16 devices but 8(.|\n)*'data=-1'") as e:
        ns.make_mesh("data=16")
    assert "jax.devices()[:" not in str(e.value)  # a subset cannot help a mesh too large


@needs_devices(8)
@pytest.mark.parametrize("tree", [3, "model", None, [1, 2]])
def test_shardings_rejects_what_is_not_a_model_or_state(tree):
    with pytest.raises(ns.UsageError, match=rf"shardings: tree must be an nnx.Module, an "
                       rf"nnx.Optimizer, an nnx.State or an abstract model, got "
                       rf"{type(tree).__name__}.*Fix: pass the model"):
        ns.shardings(tree, ns.make_mesh("data=8"), RULES)


def test_option_reads_the_innermost_rules():
    outer = Rules({"batch": "data"}).with_options(attention="ring")
    inner = Rules({"batch": "data"})
    assert ns_mesh.option("attention", "local") == "local"
    with ns_mesh.use("data=8", outer):
        assert ns_mesh.option("attention") == "ring"
        with ns_mesh.use("data=8", inner):
            assert ns_mesh.option("attention", "local") == "local"
        assert ns_mesh.option("attention") == "ring"


@pytest.mark.parametrize("axis_types", [5, [1], ["auto"], (jax.sharding.AxisType.Auto,)])
def test_make_mesh_refuses_axis_types_that_are_not_one_per_axis(axis_types):
    with pytest.raises(ns.ShardingError, match=r"axis_types=.*one jax.sharding.AxisType per axis "
                                            r"\(2 here\)"):
        ns.make_mesh("data=4,model=2", axis_types=axis_types)
