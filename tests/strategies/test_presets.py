"""The presets' mesh-axis keywords: a preset built with its axes renamed is the same preset
over the new names, its rules and optimizer-state rules entry by entry in table order (the
order decides which logical name claims a contested mesh axis), its options (a pipeline's
schedule runs over the renamed stage axis, zero2's gradient table over the renamed data
axis), its preferred sizes, collectives, the axis it lays across processes (hsdp's replica)
and default meshes. What each preset's tables do is the preset matrix's (tests/test_strategies.py:
values against one device, bytes per device, the compiled collectives).
"""

import dataclasses
import inspect

import pytest

from nnx_shard import strategies
from nnx_shard.strategies._strategy import PRESETS

RENAMES = {"data": "d", "model": "m", "expert": "e", "context": "c", "stage": "s",
           "replica": "r"}


def _renamed(value):
    if isinstance(value, str):
        return RENAMES.get(value, value)
    if isinstance(value, tuple):
        return tuple(_renamed(v) for v in value)
    return value


def _pairs(rules):
    return None if rules is None else rules.to_pairs()


def _renamed_pairs(rules):
    return None if rules is None else [(n, _renamed(v)) for n, v in rules.to_pairs()]


@pytest.mark.parametrize("name", strategies.NAMES)
def test_a_preset_with_renamed_axes_is_the_preset_over_the_new_names(name):
    params = inspect.signature(PRESETS[name]).parameters
    axes = {k: v for k, v in RENAMES.items() if k in params}
    assert axes, name  # every preset takes its mesh axes' names
    plain, renamed = strategies.get(name), strategies.get(name, **axes)
    assert renamed.name == name
    assert _pairs(renamed.rules) == _renamed_pairs(plain.rules)
    assert _pairs(renamed.opt_rules) == _renamed_pairs(plain.opt_rules)
    assert renamed.rules.indivisible == plain.rules.indivisible
    options = dict(plain.rules.options)
    if "pipeline" in options:
        schedule = options["pipeline"]
        options["pipeline"] = dataclasses.replace(schedule, axis=_renamed(schedule.axis))
    got = dict(renamed.rules.options)
    if "gradients" in options:  # a Rules table: entry by entry, like the rules themselves
        assert _pairs(got.pop("gradients")) == _renamed_pairs(options.pop("gradients"))
    assert got == options
    assert renamed.mesh_axes == _renamed(tuple(plain.mesh_axes))
    assert (renamed.sizes, renamed.collectives) == (plain.sizes, plain.collectives)
    assert renamed.across == _renamed(plain.across)
    for n in (1, 6, 8, 64):
        assert renamed.mesh_for(n) == {_renamed(k): v for k, v in plain.mesh_for(n).items()}
