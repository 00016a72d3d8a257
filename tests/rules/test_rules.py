import itertools
import json
import math
import re
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard import Fallbacks, Rules, ShardingError, ShardingWarning

MESH = {"data": 2, "fsdp": 2, "model": 2}


def test_dict_and_pairs_and_candidates():
    r = Rules([("mlp", "model"), ("mlp", "data"), ("embed", None)])
    assert r["mlp"] == ["model", "data"]
    assert r["embed"] is None
    # first fit wins: model is taken by dim 0, so dim 1 falls back to data
    assert Rules({"a": "model", "mlp": Fallbacks("model", "data")}).spec(
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
    j.write_text(json.dumps({"rules": [["batch", "data"], ["embed", ["data", "fsdp"]],
                                       ["kv", None]], "indivisible": "replicate"}))
    r = Rules.from_file(j)
    assert r["embed"] == ("data", "fsdp") and r["kv"] is None and r.indivisible == "replicate"
    t = tmp_path / "r.toml"
    t.write_text('batch = "data"\nmlp = ""\n')
    assert Rules.from_file(t) == Rules({"batch": "data", "mlp": None})
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


def test_missing_rule_fix_names_an_axis_the_mesh_has():
    data_only = Rules({"embed": "data"})
    with pytest.raises(ShardingError) as info:
        data_only.spec(("embed", "tp"), shape=(8, 8), mesh={"data": 8})
    assert info.value.args[0].endswith(
        "Fix: add a rule, e.g. rules | {'tp': 'data'}, or rules | {'tp': None} to replicate it.")
    with pytest.raises(ShardingError) as info:  # no axis that shards: replicate only
        data_only.spec(("embed", "tp"), shape=(8, 8), mesh={"data": 1})
    assert "Fix: add a rule, e.g. rules | {'tp': None} to replicate it." in str(info.value)
    assert "'model'" not in str(info.value)


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
# MaxText's `mesh_axes` and `logical_axis_rules`, copied from src/maxtext/configs/base.yml of
# AI-Hypercomputer/maxtext (commit e591f30cbbf217ed67ef71263ec0538239f9c3b8), in their order.
MAXTEXT_MESH_AXES = (
    'diloco', 'data', 'stage', 'fsdp', 'fsdp_transpose', 'context',
    'context_usp_ulysses', 'context_autoregressive', 'tensor', 'tensor_sequence', 'expert', 'autoregressive',
)
MAXTEXT_RULES = [
    ['circular_repeats', []],
    ['activation_embed_and_logits_batch', ['data', 'stage', 'fsdp', 'fsdp_transpose', 'expert']],
    ['activation_embed_and_logits_batch_sequence', ['data', 'stage', 'fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']],
    ['activation_vocab', ['tensor', 'tensor_sequence']],
    ['activation_vocab', ['tensor']],
    ['activation_vocab', 'tensor_sequence'],
    ['vocab', ['tensor', 'tensor_sequence', 'autoregressive']],
    ['embed_vocab', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']],
    ['activation_batch_attn', ['data', 'fsdp', 'fsdp_transpose', 'expert']],
    ['activation_input_length_attn', ['tensor_sequence', 'context']],
    ['activation_heads', ['tensor', 'tensor_sequence', 'autoregressive']],
    ['activation_kv_heads', ['tensor', 'tensor_sequence']],
    ['activation_length_attn', ['context', 'context_usp_ulysses']],
    ['activation_q_length', ['context', 'context_usp_ulysses']],
    ['activation_kv_length', []],
    ['activation_embed_attn', ['tensor']],
    ['activation_kv', ['tensor', 'tensor_sequence']],
    ['activation_kv_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']],
    ['activation_kv_head_dim', ['tensor', 'tensor_sequence']],
    ['heads', ['tensor', 'tensor_sequence', 'autoregressive']],
    ['q_heads', ['tensor', 'tensor_sequence', 'autoregressive']],
    ['kv_heads', ['tensor', 'tensor_sequence', 'autoregressive']],
    ['qkv', []],
    ['kv', []],
    ['kv_head_dim', []],
    ['q_lora', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']],
    ['q_lora', ['fsdp', 'context', 'context_usp_ulysses', 'expert']],
    ['q_lora_up_proj', []],
    ['kv_lora', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']],
    ['kv_lora', ['fsdp', 'context', 'context_usp_ulysses', 'expert']],
    ['kv_lora_up_proj', []],
    ['activation_batch_moe', ['data', 'fsdp', 'fsdp_transpose', 'expert']],
    ['activation_length_moe', ['context', 'context_usp_ulysses']],
    ['activation_norm_length_moe', ['tensor_sequence', 'context', 'context_usp_ulysses']],
    ['activation_embed_moe', ['tensor']],
    ['activation_mlp_moe', ['tensor', 'tensor_sequence']],
    ['activation_exp', ['expert']],
    ['exp', 'expert'],
    ['mlp_moe', ['fsdp_transpose', 'tensor', 'tensor_sequence', 'autoregressive']],
    ['embed_moe', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses']],
    ['embed_moe', ['fsdp', 'context', 'context_usp_ulysses']],
    ['activation_mlp', ['tensor', 'tensor_sequence']],
    ['activation_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']],
    ['activation_length', ['context', 'context_usp_ulysses']],
    ['activation_norm_length', ['tensor_sequence', 'context', 'context_usp_ulysses']],
    ['activation_embed', ['tensor']],
    ['activation_stage', 'stage'],
    ['mlp', ['fsdp_transpose', 'tensor', 'tensor_sequence', 'autoregressive']],
    ['gdn_head', ['fsdp_transpose', 'tensor', 'tensor_sequence', 'autoregressive']],
    ['embed', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']],
    ['embed', ['fsdp', 'context', 'context_usp_ulysses', 'expert']],
    ['norm', ['tensor']],
    ['layers', 'stage'],
    ['diloco', 'diloco'],
    ['engram_dim', ['tensor']],
    ['dense_layers', []],
    ['moe_layers', []],
    ['local_layers', []],
    ['mhc', []],
    ['prefill_activation_length', ['context', 'context_usp_ulysses']],
    ['prefill_activation_norm_length', ['tensor_sequence', 'context', 'context_usp_ulysses']],
    ['activation_prefill_kv_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']],
    ['decode_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']],
    ['decode_length', []],
    ['cache_heads', ['autoregressive', 'tensor', 'tensor_sequence']],
    ['paged_kv_heads', ['tensor']],
    ['cache_batch_prefill', []],
    ['cache_batch', []],
    ['cache_heads_none', []],
    ['cache_kv', []],
    ['cache_sequence', []],
    ['num_pages', []],
    ['tokens_per_page', []],
    ['paged_kv_head_dim_size', []],
    ['mlp_no_fsdp', ['tensor', 'tensor_sequence', 'autoregressive']],
    ['exp_with_fsdp', 'fsdp'],
]


def _norm(entry):
    """One PartitionSpec entry as a tuple of mesh axes (UNCONSTRAINED kept as is)."""
    if entry is P.UNCONSTRAINED:
        return entry
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _flax(names, pairs):
    """Flax linen's answer, with the dimensions it leaves unassigned marked None.

    A last entry per name with a unique, unused fake axis catches every dimension
    Flax's table walk left unassigned (Flax would replicate it)."""
    catch = [(n, f"unassigned:{n}") for n in names if isinstance(n, str)]
    spec = nn.logical_to_mesh_axes(tuple(names), tuple(pairs) + tuple(catch))
    out = []
    for entry in spec:
        if isinstance(entry, str) and entry.startswith("unassigned:"):
            out.append(None)
        else:
            out.append(_norm(entry))
    return out


def _fits(entry, dim, mesh):
    if entry is P.UNCONSTRAINED:
        return True
    return all(a in mesh for a in entry) and dim % math.prod(mesh[a] for a in entry) == 0


# --- table order, as Flax linen and MaxText resolve -------------------------------

@pytest.mark.parametrize(
    "pairs",
    [
        (("a", "model"), ("a", None), ("b", "model"), ("b", "data")),
        (("a", "model"), ("b", "model"), ("b", "data")),
    ],
)
def test_table_order_decides_contested_axis(pairs):
    mesh = {"data": 2, "model": 2}
    flax = nn.logical_to_mesh_axes(("b", "a"), pairs)
    assert flax == P("data", "model")
    assert Rules.from_pairs(pairs).spec(("b", "a"), shape=(4, 4), mesh=mesh) == flax
    assert Rules(pairs).spec(("b", "a"), shape=(4, 4), mesh=mesh) == flax


def test_earlier_entry_claims_axis_whatever_the_dimension_order():
    rules = Rules({"mlp": "data", "embed": "data"})
    with pytest.raises(ShardingError) as e:
        rules.spec(("embed", "mlp"), shape=(4, 4), mesh=MESH, path="w")
    msg = str(e.value)
    assert "rule 'embed' -> 'data' cannot shard dimension 0" in msg
    assert "already used by dimension 1" in msg and "table order" in msg
    assert "rules | {'embed': Fallbacks('data', None)}" in msg
    assert (rules | {"embed": Fallbacks("data", None)}).spec(("embed", "mlp"), (4, 4), MESH) == P(None, "data")


def test_unfitting_entry_tries_the_next_one():
    pairs = (("a", "tensor"), ("a", "model"), ("b", "model"), ("b", "data"))
    # Flax takes 'tensor' although the mesh has no such axis; we skip to the next entry
    assert nn.logical_to_mesh_axes(("a", "b"), pairs) == P("tensor", "model")
    assert Rules.from_pairs(pairs).spec(("a", "b"), (4, 4), MESH) == P("model", "data")
    # an odd dimension does not fit 'model': b takes it instead
    with pytest.raises(ShardingError) as e:
        Rules.from_pairs(pairs).spec(("a", "b"), (3, 4), MESH, path="w")
    msg = str(e.value)
    assert "dimension 0" in msg and "'tensor': not in the mesh" in msg
    assert "'model': size 3 is not divisible by 2" in msg
    assert Rules.from_pairs((*pairs, ("a", None))).spec(("a", "b"), (3, 4), MESH) == P(None, "model")


def test_where_flax_replicates_we_raise():
    pairs = (("a", "model"), ("b", "model"))
    assert nn.logical_to_mesh_axes(("a", "b"), pairs) == P("model", None)
    with pytest.raises(ShardingError) as e:
        Rules.from_pairs(pairs).spec(("a", "b"), (4, 4), MESH, path="layers/0/kernel")
    msg = str(e.value)
    assert "'layers/0/kernel'" in msg and "(4, 4)" in msg and "('a', 'b')" in msg
    assert "rule 'b' -> 'model'" in msg and "already used by dimension 0" in msg and "Fix" in msg
    # ... unless the table itself offers None
    assert Rules.from_pairs((*pairs, ("b", None))).spec(("a", "b"), (4, 4), MESH) == P("model", None)


def test_size_one_axis_never_blocks_but_keeps_flax_order():
    pairs = (("a", "model"), ("b", "model"), ("b", "data"))
    mesh = {"data": 2, "model": 1}
    # Flax skips b's first entry (model is taken, even though it has size 1): so do we.
    assert nn.logical_to_mesh_axes(("a", "b"), pairs) == P("model", "data")
    assert Rules.from_pairs(pairs).spec(("a", "b"), (4, 4), mesh) == P("model", "data")
    # with nothing else left, the size-1 axis is reused harmlessly (dropped)
    assert Rules.from_pairs(pairs[:2]).spec(("a", "b"), (4, 4), mesh) == P("model", None)


def test_repeated_name_in_one_array():
    rules = Rules({"embed": Fallbacks("data", None)})
    assert rules.spec(("embed", "embed"), (4, 4), MESH) == P("data", None)
    # the first entry goes to the first dimension it fits
    assert rules.spec(("embed", "embed"), (3, 4), MESH) == P(None, "data")


def test_mesh_axis_name_without_rule_comes_after_the_table():
    rules = Rules({"embed": "model"})
    assert rules.spec(("data", "embed"), (4, 4), MESH) == P("data", "model")
    with pytest.raises(ShardingError) as e:
        rules.spec(("model", "embed"), (4, 4), MESH, path="w")
    assert "'model' (a mesh axis, used directly)" in str(e.value)
    assert "already used by dimension 1" in str(e.value)


# Few axes and names, so that entries conflict often.
AX = ["a", "b", "c", "d"]
NAMES = ["x", "y", "z", "w", "v"]
some_axes = st.lists(st.sampled_from(AX), min_size=1, max_size=3, unique=True).map(tuple)
# one_of picks a branch uniformly: axes are more frequent than None / UNCONSTRAINED
axes_value = st.one_of(
    st.sampled_from(AX), some_axes, st.sampled_from(AX), some_axes, st.none(),
    st.sampled_from(AX), some_axes, st.just(P.UNCONSTRAINED),
)
# Mostly every axis present, mostly of size 2: then most of Flax's answers are valid.
meshes = st.lists(st.sampled_from([None, 1, 2, 2, 2, 3, 4]), min_size=4, max_size=4).map(
    lambda sizes: {a: s for a, s in zip(AX, sizes, strict=True) if s is not None}
)


@st.composite
def tables_and_names(draw):
    """A table (names repeated, values conflicting or not) and the logical names of
    one array, mostly names the table has, each at most once, sometimes None."""
    pairs = draw(st.lists(st.tuples(st.sampled_from(NAMES), axes_value), min_size=1, max_size=10))
    known = sorted({n for n, _ in pairs})
    pool = st.one_of(st.sampled_from(known), st.sampled_from(known), st.sampled_from(NAMES),
                     st.none())
    names = draw(st.lists(pool, min_size=1, max_size=4).filter(
        lambda n: 0 < len([x for x in n if x]) == len({x for x in n if x})))
    return pairs, names


@settings(deadline=None, max_examples=600)
@given(
    case=tables_and_names(),
    mesh=meshes,
    dims=st.lists(st.sampled_from([1, 3, 4, 6, 8, 12, 24]), min_size=4, max_size=4),
    as_lists=st.booleans(),
)
def test_matches_flax_logical_to_mesh_axes(case, mesh, dims, as_lists):
    pairs, names = case
    shape = tuple(dims[: len(names)])
    ours_pairs = [(n, list(v) if as_lists and isinstance(v, tuple) else v) for n, v in pairs]
    flax = _flax(names, pairs)
    try:
        ours = Rules.from_pairs(ours_pairs).spec(names, shape=shape, mesh=mesh, path="p")
    except ShardingError as e:
        ours = e
    assigned_ok = all(f is None or _fits(f, d, mesh) for f, d in zip(flax, shape, strict=True))
    unassigned = [i for i, f in enumerate(flax) if f is None]
    if assigned_ok and not unassigned:
        # Flax's answer is valid for these shapes: ours is exactly it
        assert not isinstance(ours, ShardingError), (flax, ours)
        assert [_norm(e) for e in ours] == flax
    elif assigned_ok:
        if isinstance(ours, ShardingError):
            assert repr(names[unassigned[0]]) in str(ours) and "Fix" in str(ours)
        else:
            # only a reused size-1 axis may fill a dimension Flax left unassigned
            assert 1 in mesh.values(), (flax, ours)
            got = [_norm(e) for e in ours]
            assert all(f is None or f == g for f, g in zip(flax, got, strict=True))
    if not isinstance(ours, ShardingError):
        seen = []
        for entry, d in zip(ours, shape, strict=True):
            entry = _norm(entry)
            assert _fits(entry, d, mesh), ours
            if entry is not P.UNCONSTRAINED:
                seen += [a for a in entry if mesh[a] > 1]
        assert len(seen) == len(set(seen)), ours


def _maxtext_mesh(**sizes):
    return {a: sizes.get(a, 1) for a in MAXTEXT_MESH_AXES}


def _drop_size_one(spec, mesh):
    """MaxText's remove_size_one_mesh_axis, applied to a spec."""
    out = []
    for entry in spec:
        axes = tuple(a for a in _norm(entry) if mesh[a] > 1)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def test_maxtext_rules_with_fsdp_transpose():
    mesh = _maxtext_mesh(fsdp=2, fsdp_transpose=2, tensor=2)
    rules = Rules.from_pairs(MAXTEXT_RULES)
    got = rules.spec(("embed", "mlp"), shape=(16, 64), mesh=mesh, path="mlp/wi/kernel")
    assert got == nn.logical_to_mesh_axes(("embed", "mlp"), MAXTEXT_RULES)
    assert _drop_size_one(got, mesh) == P("fsdp", ("fsdp_transpose", "tensor"))
    # the second 'embed' entry exists for exactly this: dimension order does not matter
    assert _drop_size_one(rules.spec(("mlp", "embed"), (64, 16), mesh), mesh) == P(
        ("fsdp_transpose", "tensor"), "fsdp"
    )
    # 'vocab' is a product of three axes, not three candidates
    assert rules["vocab"] == ("tensor", "tensor_sequence", "autoregressive")


@pytest.mark.parametrize("sizes", [{"fsdp": 8}, {"fsdp": 2, "fsdp_transpose": 2, "tensor": 2},
                                   {"data": 2, "expert": 2, "tensor": 2}])
def test_maxtext_every_pair_of_names_as_flax(sizes):
    mesh = _maxtext_mesh(**sizes)
    rules = Rules.from_pairs(MAXTEXT_RULES)
    logical = list(dict.fromkeys(n for n, _ in MAXTEXT_RULES))
    checked = 0
    for names in itertools.chain(((n,) for n in logical), itertools.permutations(logical, 2)):
        flax = _flax(names, MAXTEXT_RULES)
        try:
            ours = [_norm(e) for e in rules.spec(names, shape=(8,) * len(names), mesh=mesh)]
        except ShardingError as e:
            assert None in flax, (names, flax, e)
            continue
        assert all(f is None or f == o for f, o in zip(flax, ours, strict=True)), (names, flax)
        checked += None not in flax
    assert checked > 3000


def _maxtext_yaml():
    """A config file laid out as MaxText's base.yml: other keys around a
    `logical_axis_rules:` flow list with comments inside."""
    rows = []
    for i, (name, value) in enumerate(MAXTEXT_RULES):
        if i % 10 == 0:
            rows.append(f"                      # ---- group {i // 10}")
        rows.append(f"                      [{name!r}, {value!r}],")
    return "\n".join([
        'run_name: ""',
        "override_logical_axis_rules: false # merge instead of override",
        'shard_mode: "auto" # can be either auto or explicit',
        f"mesh_axes: {list(MAXTEXT_MESH_AXES)!r}",
        "logical_axis_rules: [",
        *rows,
        "                  ]",
        "data_sharding: [['data', 'stage', 'fsdp', 'fsdp_transpose', 'context', 'expert']]",
        "ici_fsdp_transpose_parallelism: 1",
        "",
    ])


@pytest.mark.parametrize("suffix", [".yml", ".yaml"])
def test_maxtext_base_yml_loads_unchanged(tmp_path, suffix):
    pytest.importorskip("yaml")
    path = tmp_path / f"base{suffix}"
    path.write_text(_maxtext_yaml())
    rules = Rules.from_file(path)
    assert rules == Rules.from_pairs(MAXTEXT_RULES)
    assert len(rules.to_pairs()) == len(MAXTEXT_RULES) and "mesh_axes" not in rules
    mesh = _maxtext_mesh(fsdp=2, fsdp_transpose=2, tensor=2)
    for names, shape in [
        (("embed", "mlp"), (16, 64)),
        (("mlp", "embed"), (64, 16)),
        (("vocab", "embed_vocab"), (64, 16)),
        (("activation_batch", "activation_length", "activation_embed"), (8, 4, 16)),
        (("embed", "q_heads", "kv_head_dim"), (16, 8, 4)),
        (("exp", "embed_moe", "mlp_moe"), (4, 16, 64)),
        (("layers", "embed", "mlp"), (3, 16, 64)),
        (("activation_batch", "activation_length", "activation_vocab"), (8, 4, 64)),
    ]:
        assert rules.spec(names, shape, mesh) == nn.logical_to_mesh_axes(names, MAXTEXT_RULES), names


def test_yaml_without_pyyaml_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "base.yml"
    path.write_text("logical_axis_rules: [['batch', 'data']]\n")
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ImportError, match=r"pip install nnx_shard\[yaml\]"):
        Rules.from_file(path)


# --- the pairs format --------------------------------------------------------------

def test_from_pairs_values():
    rules = Rules.from_pairs([
        ["batch", "data"],
        ["vocab", ["tensor", "expert"]],
        ("heads", ("tensor", "expert")),
        ["mlp", "model"],
        ["mlp", []],
        ["norm", ""],
        ["kv", None],
        ["act", P.UNCONSTRAINED],
    ])
    assert rules["vocab"] == rules["heads"] == ("tensor", "expert")
    assert rules["mlp"] == ["model", None]
    assert rules["norm"] is None and rules["kv"] is None and rules["act"] is P.UNCONSTRAINED
    # in Rules({...}) the same list is refused as ambiguous; a tuple is the same product
    with pytest.raises(ShardingError, match="ambiguous"):
        Rules({"vocab": ["tensor", "expert"]})
    assert Rules({"vocab": ("tensor", "expert")})["vocab"] == rules["vocab"]
    assert Rules.from_pairs(rules.to_pairs()) == rules == Rules(rules.to_pairs())


def test_from_pairs_bad_input():
    with pytest.raises(ShardingError, match="not a \\[logical, mesh\\] pair"):
        Rules.from_pairs([["batch"]])
    with pytest.raises(ShardingError, match="Rules\\(\\{...\\}\\)"):
        Rules.from_pairs({"batch": "data"})
    with pytest.raises(ShardingError, match="mesh axis names \\(strings\\), got None"):
        Rules.from_pairs([["vocab", ["tensor", None]]])
    with pytest.raises(ShardingError, match="names a mesh axis twice"):
        Rules.from_pairs([["vocab", ["tensor", "tensor"]]])
    with pytest.raises(ShardingError, match="non-empty strings"):
        Rules.from_pairs([[None, "data"]])
    with pytest.raises(ShardingError, match="rule 'batch' -> 5"):
        Rules.from_pairs([["batch", 5]])


def test_from_file_pairs_formats(tmp_path):
    pairs = [["batch", "data"], ["vocab", ["tensor", "expert"]], ["mlp", "model"], ["mlp", None]]
    want = Rules.from_pairs(pairs)
    j = tmp_path / "r.json"
    j.write_text(json.dumps(pairs))
    assert Rules.from_file(j) == want
    for key in ("logical_axis_rules", "rules"):
        j.write_text(json.dumps({key: pairs, "other": 1, "indivisible": "replicate"}))
        got = Rules.from_file(j)
        assert got == Rules.from_pairs(pairs, indivisible="replicate")
    t = tmp_path / "r.toml"
    t.write_text('seed = 0\nlogical_axis_rules = [["batch", "data"], ["vocab", ["tensor", "expert"]],'
                 ' ["mlp", "model"], ["mlp", ""]]\n')
    assert Rules.from_file(t) == want
    j.write_text(json.dumps({"rules": pairs, "logical_axis_rules": pairs}))
    with pytest.raises(ShardingError, match="both"):
        Rules.from_file(j)
    j.write_text(json.dumps({"rules": 3}))
    with pytest.raises(ShardingError, match="list of \\[logical, mesh\\] pairs or a table"):
        Rules.from_file(j)


# --- '' is not a mesh axis ------------------------------------------------------------

@pytest.mark.parametrize("value", ["", ("data", ""), Fallbacks("model", "")])
def test_empty_string_axis_is_an_error(value):
    with pytest.raises(ShardingError) as e:
        Rules({"batch": value})
    msg = str(e.value)
    assert "rule 'batch'" in msg and "empty string" in msg and "use None to replicate" in msg


# --- merge, order, printing ---------------------------------------------------------

def test_merge_replaces_entries_in_place():
    rules = Rules([("a", "model"), ("b", "model"), ("b", "data"), ("a", None)])
    merged = rules | {"b": "fsdp", "c": "data"}
    assert merged.to_pairs() == [("a", "model"), ("b", "fsdp"), ("a", None), ("c", "data")]
    assert (rules | {"a": "data"}).to_pairs() == [("a", "data"), ("b", "model"), ("b", "data")]
    # order is part of the table: the same entries in another order resolve differently
    assert Rules({"a": "data", "b": "data"}) != Rules({"b": "data", "a": "data"})
    assert repr(rules) == "Rules([('a', 'model'), ('b', 'model'), ('b', 'data'), ('a', None)])"
    assert eval(repr(rules)) == rules
    text = str(rules).splitlines()
    assert "priority order" in text[0] and text[1].split() == ["a", "'model'"]
    assert text[4].split() == ["a", "replicated"]


# --- PartitionSpec.UNCONSTRAINED ------------------------------------------------------

def test_unconstrained_rule_for_activations():
    rules = Rules({"batch": "data", "act_embed": P.UNCONSTRAINED, "embed": "model"})
    assert repr(rules) == "Rules({'batch': 'data', 'act_embed': P.UNCONSTRAINED, 'embed': 'model'})"
    assert rules.spec(("batch", "act_embed"), (8, 6), MESH) == P("data", P.UNCONSTRAINED)
    mesh = ns.make_mesh("data=4,model=2", axis_types="auto")
    x = jnp.arange(32.0).reshape(8, 4)

    def f(x):
        return ns.constrain(x * 2, ("batch", "act_embed"))

    with ns.use(mesh, rules):
        lowered = jax.jit(f).lower(x)
        y = jax.jit(f)(x)
    # Shardy writes an unconstrained dimension as {?} (a replicated one as {})
    assert '<@mesh, [{"data"}, {?}]>' in lowered.as_text()
    assert y.sharding.spec[0] == "data"
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)


def test_unconstrained_for_a_parameter_is_an_error():
    model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    ns.annotate(model, {"kernel": ("embed", "mlp"), "bias": ("mlp",)})
    rules = Rules({"embed": P.UNCONSTRAINED, "mlp": "model"})
    with pytest.raises(ShardingError) as e:
        ns.shardings(model, ns.make_mesh("data=4,model=2"), rules)
    msg = str(e.value)
    assert "'kernel'" in msg and "UNCONSTRAINED" in msg and "stored array" in msg
    assert "rules | {'embed': None}" in msg


def test_mesh_axes_given_directly_are_fixed_first():
    rules = Rules({"embed": Fallbacks("data", None)})
    # as in Flax, axes written directly in the names block the table's entries
    assert rules.spec(("embed", ("data", "model")), (8, 8), MESH) == P(None, ("data", "model"))
    assert rules.spec(("embed", ("fsdp", "model")), (8, 8), MESH) == P("data", ("fsdp", "model"))
    with pytest.raises(ShardingError, match=r"\('fsdp', 'tensor'\) \(mesh axes given directly\)"):
        rules.spec(("embed", ("fsdp", "tensor")), (8, 8), MESH, path="w")


def test_options_travel_with_the_table():
    base = Rules({"batch": "data"})
    ring = base.with_options(attention="ring", collective_matmul=2)
    assert base.options == {} and ring.options == {"attention": "ring", "collective_matmul": 2}
    assert ring != base and hash(ring) != hash(base)
    assert Rules(ring).options == ring.options
    assert (ring | {"embed": "data"}).options == ring.options
    assert (base | ring).options == ring.options
    assert ring.with_options(collective_matmul=None).options == {"attention": "ring"}
    assert "options={'attention': 'ring', 'collective_matmul': 2}" in repr(ring)
    with pytest.raises(ShardingError, match="not hashable"):
        base.with_options(pipeline=[1, 2])


@pytest.mark.parametrize("make", [
    lambda: Rules({}, options={"atention": "ring"}),
    lambda: Rules({}).with_options(atention="ring"),
    lambda: Rules({}, options={"attention": "ring"}).with_options(atention="dense"),
])
def test_unknown_options_are_refused_with_a_did_you_mean(make):
    with pytest.raises(ShardingError, match=r"Rules option 'atention' is not an option any "
                       r"operation reads.*Did you mean 'attention'\?.*Known options: attention, "
                       r"collective_matmul, gradients, pipeline"):
        make()


def test_an_op_registered_declares_its_option(monkeypatch):
    from nnx_shard._parallel import registry

    monkeypatch.setattr(registry, "_OPS", dict(registry._OPS))
    with pytest.raises(ShardingError, match="'my_probe' is not an option"):
        Rules({}, options={"my_probe": 1})
    registry.register(registry.ParallelOp("my_probe", "my_probe"))
    assert Rules({}, options={"my_probe": 1}).options == {"my_probe": 1}


# -- hostile files and numbers ------------------------------------------------------------

# Nine levels of nine aliases (~350 bytes) stand for 9**9 values under 'mlp'.
YAML_BOMB = "".join(
    f"{chr(97 + i)}: &{chr(97 + i)} [" + ",".join(
        ['"lol"'] * 9 if i == 0 else [f"*{chr(96 + i)}"] * 9) + "]\n" for i in range(9)
) + "rules: {mlp: *i}\n"


def test_a_yaml_alias_bomb_fails_fast_with_a_short_message(tmp_path):
    assert len(YAML_BOMB) < 400
    path = tmp_path / "bomb.yaml"
    path.write_text(YAML_BOMB)
    # Refused by its expansion count, before expanding (billions of nodes otherwise).
    with pytest.raises(ShardingError, match=r"bomb.yaml.*aliases expand to more than 100,000"
                       ) as e:
        Rules.from_file(path)
    assert len(str(e.value)) < 400
    # The same aliases, few: a table that reuses one product of mesh axes loads.
    path.write_text("c: &c [model, data]\nrules: [[mlp, *c], [heads, *c]]\n")
    assert Rules.from_file(path)["heads"] == ("model", "data")


def test_messages_that_show_user_values_are_bounded(tmp_path):
    huge = ("x" * 10**6, 5)
    for make in (lambda: Rules({"a": huge}), lambda: Rules.from_pairs([["a", [huge]]]),
                 lambda: Rules([("a", "b", "x" * 10**6)]), lambda: Rules({"a": [[1] * 10**6]}),
                 lambda: Rules({}).spec(("nope" * 10**5,), shape=(4,)),
                 lambda: ns.make_mesh("data=" + "x" * 10**6)):
        with pytest.raises((ShardingError, ns.UsageError)) as e:
            make()
        assert len(str(e.value)) < 1500, str(e.value)[:200]
    (tmp_path / "big.json").write_text(json.dumps([["a", ["x" * 500_000, 7]]]))
    with pytest.raises(ShardingError, match=r"big.json': rule 'a' -> \['xxx.*\.\.\.") as e:
        Rules.from_file(tmp_path / "big.json")
    assert len(str(e.value)) < 1500


def _finishes(fn, seconds=120):
    """Runs ``fn`` on a daemon thread: (finished, what it raised or returned). A file that
    blocks (a FIFO with no writer, /dev/zero) would block for good; ``seconds`` only
    keeps such a failure from hanging the run."""
    import threading

    out = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return (not t.is_alive()), (out[0] if out else None)


def test_rules_files_that_are_not_regular_files_are_refused_without_blocking(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "dir.toml").mkdir()
    os.symlink("/dev/zero", tmp_path / "zero.yaml")
    for name, kind in [("fifo.json", "a FIFO"), ("dir.toml", "a folder"),
                       ("zero.yaml", "a device")]:
        done, got = _finishes(lambda name=name: Rules.from_file(tmp_path / name))
        assert done, f"{name}: still blocked (hang guard)"
        assert isinstance(got, ShardingError) and f"is {kind}, not a regular file" in str(got)


@pytest.mark.parametrize("name, content, error, match", [
    ("bin.json", b"\xff\xfe\x00\x81", ShardingError, r"is not UTF-8 text \(byte 0xff at offset 0\)"),
    ("bad.yaml", b"a: \xff\n", ShardingError, "is not UTF-8 text"),
    ("bad.toml", b'a = "\xfe"\n', ShardingError, "is not UTF-8 text"),
    ("deep.json", b"[" * 100_000 + b"]" * 100_000, ShardingError, "nested too deeply"),
    ("deep.yaml", b"[" * 20_000 + b"]" * 20_000, ShardingError, "nested too deeply"),
    ("dup.json", b'{"mlp": "model", "mlp": "data"}', ShardingError, "holds the key 'mlp' twice"),
    ("dup.yaml", b"mlp: model\nmlp: data\n", ShardingError, "holds the key 'mlp' twice"),
    ("dup2.yml", b"rules:\n  embed: null\n  mlp: model\n  mlp: data\n", ShardingError,
     "holds the key 'mlp' twice"),
    ("dup.toml", b'mlp = "model"\nmlp = "data"\n', ShardingError, "could not be parsed"),
    ("tag.yaml", b"a: !!python/object/apply:os.getcwd []\n", ShardingError,
     "could not be parsed"),
    ("empty.yaml", b"", ShardingError, "must hold a list"),
    ("nan.json", b'{"a": NaN}', ShardingError, r"nan.json': rule 'a' -> nan"),
])
def test_unreadable_rules_files_get_one_clear_error(tmp_path, name, content, error, match):
    (tmp_path / name).write_bytes(content)
    done, got = _finishes(lambda: Rules.from_file(tmp_path / name))
    assert done and isinstance(got, error), got
    assert name in str(got) and len(str(got)) < 1000
    assert re.search(match, str(got)), str(got)


def test_a_huge_rules_file_is_refused_before_it_is_parsed(tmp_path):
    with open(tmp_path / "huge.json", "wb") as f:
        f.truncate(17 << 20)  # sparse: nothing is written
    with pytest.raises(ShardingError, match="huge.json' is larger than 16 MiB"):
        Rules.from_file(tmp_path / "huge.json")


@pytest.mark.parametrize("path, error, match", [
    (None, ShardingError, "path must be a str or os.PathLike, got NoneType"),
    (b"rules.json", ShardingError, "path must be a str or os.PathLike, got bytes"),
    (5, ShardingError, "got int 5"), ("", ShardingError, "names no file"),
    ("/no/such/rules.toml", FileNotFoundError, "rules file '/no/such/rules.toml': no such file"),
])
def test_rules_file_paths_that_name_no_file(path, error, match):
    with pytest.raises(error, match=match):
        Rules.from_file(path)


@pytest.mark.parametrize("shape", [(-4,), (4.5,), (math.nan,), (True,), (None,), "4", 4])
def test_spec_refuses_shapes_that_are_not_sizes(shape):
    with pytest.raises(ShardingError, match=r"shape.*Fix: pass the array's shape"):
        Rules({"mlp": "model"}).spec(("mlp",), shape=shape, mesh={"model": 2})


@pytest.mark.parametrize("size", [0, -2, math.nan, 2.5, True, None, "2"])
def test_spec_refuses_mesh_sizes_that_are_not_device_counts(size):
    with pytest.raises(ShardingError, match=r"mesh axis 'model' has size .*mesh sizes are ints "
                                            r">= 1\. Fix"):
        Rules({"mlp": "model"}).spec(("mlp",), shape=(4,), mesh={"model": size})


@pytest.mark.parametrize("indivisible", [True, 0, "", "x", ["error"]])
def test_indivisible_must_name_a_policy(indivisible):
    with pytest.raises(ShardingError, match="expected 'error' or 'replicate'"):
        Rules({}, indivisible=indivisible)
