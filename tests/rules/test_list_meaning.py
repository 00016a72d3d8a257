"""One literal, one meaning: a list is a product of mesh axes (as Flax and MaxText read it)
wherever it is accepted, refused as ambiguous in ``Rules({...})``; fallbacks are explicit."""

import json

import pytest
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard import Fallbacks, Rules, ShardingError

MESH = {"data": 2, "model": 2, "fsdp": 2}


@pytest.mark.parametrize("make", [lambda v: Rules({"mlp": v}), lambda v: Rules([("mlp", v)]),
                                  lambda v: Rules({"a": "data"}) | {"mlp": v}])
def test_a_list_in_rules_is_refused_with_both_spellings(make):
    with pytest.raises(ShardingError) as e:
        make(["model", "data"])
    msg = str(e.value)
    assert "rule 'mlp'" in msg and "ambiguous" in msg
    assert "('model', 'data')" in msg and "Fallbacks('model', 'data')" in msg


def test_a_tuple_is_a_product_in_every_constructor(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps([["mlp", ["model", "data"]]]))
    tables = [Rules({"mlp": ("model", "data")}), Rules([("mlp", ("model", "data"))]),
              Rules.from_pairs([("mlp", ("model", "data"))]),
              Rules.from_pairs([["mlp", ["model", "data"]]]), Rules.from_file(path),
              Rules({}) | {"mlp": ("model", "data")}]
    for t in tables:
        assert t == tables[0]
        assert t["mlp"] == ("model", "data")
        assert t.spec(("mlp",), shape=(8,), mesh=MESH) == P(("model", "data"))


def test_fallbacks_keep_the_ordered_candidates():
    r = Rules({"a": "model", "mlp": Fallbacks("model", "data", None)})
    assert r.candidates("mlp") == (("model",), ("data",), ())
    assert r.spec(("a", "mlp"), shape=(4, 4), mesh=MESH) == P("model", "data")
    assert r.spec(("mlp",), shape=(4,), mesh=MESH) == P("model")
    assert r.spec(("mlp",), shape=(3,), mesh=MESH) == P(None)
    assert r["mlp"] == Fallbacks("model", "data", None) and repr(r["mlp"]).startswith("Fallbacks(")
    assert Rules(dict(r)) == r  # a table's own values build it again


def test_from_pairs_and_the_equivalent_dict_resolve_identically():
    pairs = [["batch", "data"], ["embed", ["fsdp", "model"]], ["embed", "fsdp"], ["mlp", "model"],
             ["mlp", None], ["norm", []]]
    table = Rules({"batch": "data", "embed": Fallbacks(("fsdp", "model"), "fsdp"),
                   "mlp": Fallbacks("model", None), "norm": None})
    assert Rules.from_pairs(pairs) == table
    for names, shape in [(("embed", "mlp"), (8, 8)), (("embed", "mlp"), (2, 6)),
                         (("batch", "embed", "mlp"), (4, 4, 3)), (("norm", "embed"), (4, 2))]:
        assert Rules.from_pairs(pairs).spec(names, shape, MESH) == table.spec(names, shape, MESH)


def test_fallbacks_in_pairs_and_arrays_in_dict_files_are_refused(tmp_path):
    with pytest.raises(ShardingError, match="repeated pair"):
        Rules.from_pairs([("mlp", Fallbacks("model", None))])
    with pytest.raises(ShardingError, match="a tuple for a product"):
        Rules({"mlp": Fallbacks(["model", "data"], None)})
    path = tmp_path / "r.toml"
    path.write_text('[rules]\nmlp = ["model", ""]\n')
    with pytest.raises(ShardingError, match=r"r.toml.*rule 'mlp'.*ambiguous.*logical_axis_rules"):
        Rules.from_file(path)


def test_presets_spell_fallbacks_explicitly():
    assert ns.strategies.get("tp").rules["kv_heads"] == Fallbacks("model", None)
    assert ns.strategies.get("ep").rules["batch"] == Fallbacks(("data", "expert"), "data")
