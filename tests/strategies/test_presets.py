"""Every preset's tables, mesh axes and default shapes, pinned.

``presets.json`` holds what each preset of :mod:`nnx_shard.strategies` resolved to
before the presets were written as composed tables: the rules and optimizer-state
rules entry by entry in table order (the order decides which logical name claims a
contested mesh axis), their options and ``indivisible`` policy, the mesh axes, the
preferred sizes, the collectives and :meth:`Strategy.mesh_for` on 1, 6, 8 and 64
devices; for the default axis names, renamed ones, and the pipeline presets'
circular schedule. A change to any of them is a change of behaviour.
"""

import inspect
import json
from pathlib import Path

import pytest

from nnx_shard import strategies
from nnx_shard.strategies._strategy import PRESETS

EXPECTED = json.loads((Path(__file__).parent / "presets.json").read_text())
RENAMES = {"data": "d", "model": "m", "expert": "e", "context": "c", "stage": "s"}


def rules_dict(r):
    if r is None:
        return None
    return {"pairs": [[n, list(v) if isinstance(v, tuple) else v] for n, v in r.to_pairs()],
            "options": {k: repr(v) for k, v in r.options.items()},
            "indivisible": r.indivisible}


def as_dict(s):
    return {"name": s.name, "rules": rules_dict(s.rules), "opt_rules": rules_dict(s.opt_rules),
            "mesh_axes": list(s.mesh_axes), "sizes": list(s.sizes),
            "collectives": list(s.collectives),
            "mesh_for": {str(n): list(map(list, s.mesh_for(n).items())) for n in (1, 6, 8, 64)}}


def test_names_are_the_pinned_presets_in_order():
    assert list(strategies.NAMES) == EXPECTED["NAMES"]


@pytest.mark.parametrize("name", EXPECTED["NAMES"])
def test_preset_resolves_as_pinned(name):
    assert as_dict(strategies.get(name)) == EXPECTED[name]


@pytest.mark.parametrize("name", EXPECTED["NAMES"])
def test_preset_with_renamed_axes_resolves_as_pinned(name):
    params = inspect.signature(PRESETS[name]).parameters
    axes = {k: v for k, v in RENAMES.items() if k in params}
    assert as_dict(strategies.get(name, **axes)) == EXPECTED[name + "@renamed"]


@pytest.mark.parametrize("name", ["pp", "pp_fsdp", "pp_tp"])
def test_circular_pipeline_presets_resolve_as_pinned(name):
    s = PRESETS[name](repeats=2, allow_few_microbatches=True, remat=True)
    assert as_dict(s) == EXPECTED[name + "@circular"]
