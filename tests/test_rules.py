import json
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from nnx_shard import Rules, ShardingError, ShardingWarning

MESH = {"data": 2, "fsdp": 2, "model": 2}


def test_dict_and_pairs_and_candidates():
    r = Rules([("mlp", "model"), ("mlp", "data"), ("embed", None)])
    assert r["mlp"] == ["model", "data"]
    assert r["embed"] is None
    # first fit wins: model is taken by dim 0, so dim 1 falls back to data
    assert Rules({"a": "model", "mlp": ["model", "data"]}).spec(
        ("a", "mlp"), shape=(4, 4), mesh=MESH
    ) == P("model", "data")
    assert r.spec(("mlp",), shape=(4,), mesh=MESH) == P("model")


def test_first_fit_not_last_wins():
    r = Rules([("mlp", "model"), ("mlp", None)])
    assert r.spec(("mlp",), shape=(8,), mesh=MESH) == P("model")
    assert r.spec(("mlp",), shape=(3,), mesh=MESH) == P(None)


def test_tuple_value_shards_over_product():
    r = Rules({"embed": ("data", "fsdp")})
    assert r.spec(("embed",), shape=(8,), mesh=MESH) == P(("data", "fsdp"))
    with pytest.raises(ShardingError, match="not divisible by 4"):
        r.spec(("embed",), shape=(6,), mesh=MESH, path="w")


def test_frozen_printable_mergeable():
    r = Rules({"batch": "data", "mlp": "model"})
    with pytest.raises(AttributeError):
        r.x = 1
    merged = r | {"mlp": None, "heads": "model"}
    assert merged["mlp"] is None and merged["heads"] == "model" and r["mlp"] == "model"
    assert repr(r) == "Rules({'batch': 'data', 'mlp': 'model'})"
    text = str(merged)
    assert "replicated" in text and "heads" in text.splitlines()[3]
    assert r == Rules({"batch": "data", "mlp": "model"}) and hash(r) == hash(Rules(r))


def test_from_json_and_toml(tmp_path):
    j = tmp_path / "r.json"
    j.write_text(json.dumps({"rules": {"batch": "data", "embed": [["data", "fsdp"]], "kv": None},
                             "indivisible": "replicate"}))
    r = Rules.from_file(j)
    assert r["embed"] == ("data", "fsdp") and r["kv"] is None and r.indivisible == "replicate"
    t = tmp_path / "r.toml"
    t.write_text('batch = "data"\nmlp = ["model", ""]\n')
    assert Rules.from_file(t) == Rules({"batch": "data", "mlp": ["model", None]})
    assert Rules.from_file(j).to_dict()["embed"] == [["data", "fsdp"]]
    bad = tmp_path / "r.ini"
    bad.write_text("x")
    with pytest.raises(ShardingError, match="unknown format"):
        Rules.from_file(bad)


def test_size_one_axes_always_fit():
    mesh = {"data": 8, "model": 1}
    r = Rules({"a": "model", "b": "model"})
    assert r.spec(("a", "b"), shape=(3, 5), mesh=mesh) == P("model", None)


def test_mesh_axis_name_used_directly():
    assert Rules({}).spec((None, "model"), shape=(4, 4), mesh=MESH) == P(None, "model")


# --- bad input: each names the path, shape, names, rule and a fix ------------------

def err(rules, names, shape=(4, 4), mesh=MESH):
    with pytest.raises(ShardingError) as e:
        rules.spec(names, shape=shape, mesh=mesh, path="layers/0/kernel")
    msg = str(e.value)
    assert "layers/0/kernel" in msg and "Fix" in msg
    return msg


def test_unknown_logical_name_suggests():
    msg = err(Rules({"embed": "data", "mlp": "model"}), ("embed", "mpl"))
    assert "'mpl'" in msg and "Did you mean 'mlp'" in msg and "(4, 4)" in msg


def test_missing_mesh_axis():
    msg = err(Rules({"embed": "data", "mlp": "tensor"}), ("embed", "mlp"))
    assert "'tensor'" in msg and "not in the mesh" in msg and "data=2" in msg
    assert "rule 'mlp' -> 'tensor'" in msg


def test_axis_used_twice():
    msg = err(Rules({"embed": "data", "mlp": "data"}), ("embed", "mlp"))
    assert "already used by dimension 0" in msg and "rule 'mlp' -> 'data'" in msg


def test_rank_mismatch_and_stacked_hint():
    msg = err(Rules({"embed": "data"}), ("embed",))
    assert "rank 2" in msg and "PARTITION_NAME" in msg
    msg = err(Rules({"embed": "data"}), ("embed", None, None))
    assert "3 logical names" in msg and "PARTITION_NAME" not in msg


def test_indivisible_error_and_replicate_option():
    msg = err(Rules({"embed": "data", "mlp": "model"}), ("embed", "mlp"), shape=(4, 3))
    assert "size 3 is not divisible by 2" in msg and "indivisible='replicate'" in msg
    r = Rules({"embed": "data", "mlp": "model"}, indivisible="replicate")
    with pytest.warns(ShardingWarning, match="layers/0/kernel"):
        assert r.spec(("embed", "mlp"), shape=(4, 3), mesh=MESH, path="layers/0/kernel") == P(
            "data", None
        )


def test_non_string_names():
    msg = err(Rules({"embed": "data"}), ("embed", 3))
    assert "entry 1 is 3 (int)" in msg
    with pytest.raises(ShardingError, match="one name"):
        Rules({}).spec("embed", path="x")


def test_bad_tables():
    with pytest.raises(ShardingError, match="non-empty strings"):
        Rules({3: "data"})
    with pytest.raises(ShardingError, match="mesh axis twice"):
        Rules({"embed": ("data", "data")})
    with pytest.raises(ShardingError, match="must be a mesh axis name"):
        Rules({"embed": 5})
    with pytest.raises(ShardingError, match="not a"):
        Rules([("embed",)])
    with pytest.raises(ShardingError, match="indivisible"):
        Rules({}, indivisible="maybe")


# --- property: a valid spec or a ShardingError, nothing else ------------------------

AXES = ["a", "b", "c", "d"]
LOGICAL = ["x", "y", "z", "w"]
placement = st.one_of(
    st.none(), st.sampled_from(AXES), st.lists(st.sampled_from(AXES), min_size=1, max_size=3).map(tuple)
)
rule_value = st.one_of(placement, st.lists(placement, min_size=1, max_size=3))


@settings(deadline=None, max_examples=400)
@given(
    mesh=st.dictionaries(st.sampled_from(AXES[:3]), st.integers(1, 8), min_size=1, max_size=3),
    table=st.dictionaries(st.sampled_from(LOGICAL), rule_value, max_size=4),
    names=st.lists(st.one_of(st.none(), st.sampled_from(LOGICAL), st.integers()), max_size=4),
    shape=st.lists(st.integers(1, 64), max_size=4),
    indivisible=st.sampled_from(["error", "replicate"]),
)
def test_spec_is_valid_or_sharding_error(mesh, table, names, shape, indivisible):
    try:
        rules = Rules(table, indivisible=indivisible)
    except ShardingError as e:
        assert "rule" in str(e)
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ShardingWarning)
            spec = rules.spec(names, shape=shape, mesh=mesh, path="the/param")
    except ShardingError as e:
        assert "'the/param'" in str(e) and "Fix" in str(e)
        return
    assert isinstance(spec, P) and len(spec) == len(shape)
    seen = []
    for dim, entry in zip(shape, spec, strict=True):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        prod = 1
        for a in axes:
            assert a in mesh
            prod *= mesh[a]
        seen += axes
        assert dim % prod == 0
    assert len(seen) == len(set(seen)), spec
