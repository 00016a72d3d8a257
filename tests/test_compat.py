"""nnx_shard/_compat.py: every JAX name nnx_shard reads without a public API is where it
looks for it and does what it relies on, on the installed jax (CI runs this on the oldest
and the newest supported versions). When a release moves one, these fail naming the name
and the jax version, instead of nnx_shard losing a check or a memory saving in silence."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import jax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard import _compat
from tests.conftest import needs_devices

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
JAX = f"jax {jax.__version__}"


def _explicit_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def test_supported_ranges_are_pyproject_pins_and_the_installed_versions_are_in_them():
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    for package, (low, high) in _compat.SUPPORTED.items():
        pin = f"{package}>={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
        assert pin in deps, (pin, deps)
    assert _compat.SUPPORTED["jax"][0] <= _compat.JAX_VERSION < _compat.SUPPORTED["jax"][1], JAX
    assert (_compat.SUPPORTED["flax"][0] <= _compat.FLAX_VERSION
            < _compat.SUPPORTED["flax"][1]), importlib.metadata.version("flax")


def test_versions_are_the_first_three_numbers_of_the_release():
    assert _compat.JAX_VERSION == tuple(
        int(n) for n in re.findall(r"\d+", importlib.metadata.version("jax"))[:3])
    assert len(_compat.JAX_VERSION) == 3 and len(_compat.FLAX_VERSION) == 3


@needs_devices(8)
def test_sharding_type_error_is_what_jax_raises_on_explicit_axes():
    x = jax.device_put(jax.numpy.ones((8, 16)), NamedSharding(_explicit_mesh(), P("data", None)))
    with pytest.raises(Exception) as info:  # the class is checked below
        jax.jit(lambda a: a.reshape(4, 32))(x)
    assert isinstance(info.value, _compat.ShardingTypeError), (JAX, type(info.value))
    assert "This reshape is not supported" in str(info.value)
    assert "float32[8@data,16]" in str(info.value)
    assert ns._errors.is_sharding_type_error(info.value)


@needs_devices(8)
def test_duplicate_spec_error_is_what_jax_raises_for_one_axis_on_two_dims():
    with pytest.raises(Exception) as info:  # the class is checked below
        NamedSharding(_explicit_mesh(), P("data", "data"))
    assert isinstance(info.value, _compat.DuplicateSpecError), (JAX, type(info.value))
    assert "P('data', 'data') has duplicate entries for `data`" in str(info.value)
    assert ns._errors.is_sharding_type_error(info.value)


@needs_devices(8)  # the simulated CPU devices: the rolled rule is CPU's
def test_threefry_parameters_unroll_the_cpu_rule_for_that_lowering_only():
    traced = jax.jit(lambda k: jax.random.bits(k, (64,))).trace(jax.random.key(0))
    # JAX's CPU rule rolls threefry's rounds into a while loop; the generic rule does not.
    assert "stablehlo.while" in traced.lower().as_text(), JAX
    params = _compat.threefry_lowering_parameters()
    assert "stablehlo.while" not in traced.lower(_private_parameters=params).as_text(), JAX
    # The registry is untouched: the next plain lowering still gets JAX's CPU rule.
    assert "stablehlo.while" in traced.lower().as_text(), JAX


def test_cluster_kinds_and_distributed_state_are_jax_s():
    kinds = _compat.cluster_kinds()
    assert {"slurm", "ompi"} <= {kind.name for kind in kinds}, JAX
    assert all(callable(kind.is_env_present) and hasattr(kind, "opt_in_only_method")
               for kind in kinds), JAX
    state = _compat.distributed_state()
    assert state is _compat.distributed_state()
    assert hasattr(state, "client") and hasattr(state, "coordinator_address"), JAX
    if not jax.distributed.is_initialized():
        assert state.client is None and state.coordinator_address is None


def test_a_moved_name_is_an_import_error_naming_it_and_the_jax_version():
    with pytest.raises(ImportError) as info:
        _compat.private("jax._src.core", "NoSuchName")
    assert str(info.value) == (
        f"jax {importlib.metadata.version('jax')} has no jax._src.core.NoSuchName, which "
        "nnx_shard reads (nnx_shard/_compat.py). nnx_shard supports jax>=0.10.2,<0.13 and "
        "flax>=0.12.8,<0.13. Fix: install a jax in that range, e.g. "
        "pip install 'jax>=0.10.2,<0.13'")
    with pytest.raises(ImportError, match=r"jax \S+ has no jax\._src\.gone\.X, which"):
        _compat.private("jax._src.gone", "X")


def test_the_library_reads_jax_internals_only_through_compat():
    root = Path(ns.__file__).parent
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if "jax._src" in p.read_text(encoding="utf-8"))
    assert readers == ["_compat.py"]


def test_ci_installs_each_lower_bound_of_pyproject_in_its_oldest_venv():
    # .ci/oldest.txt is what CI's Python 3.11 venv is constrained to: the low end tested.
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    floors = {}
    for requirement in requirements:
        m = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([0-9.]+)", requirement)
        if m:
            floors[m.group(1).lower()] = m.group(2)
    floors["jaxlib"] = floors["jax"]  # jax pins its own jaxlib; the two release together
    lines = (PYPROJECT.parent / ".ci" / "oldest.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    assert pins == {name: floors[name] for name in pins}
    assert {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "qwix"} <= set(pins)
