"""The models compute today's logits bit for bit: every family fixture and the reference
model's test-sized configs against tests/fixtures/golden_logits.npz
(tests/fixtures/make_golden_logits.py wrote it, per jaxlib version and platform, from
the code before the model rewrites it guards)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "make_golden_logits.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_golden_logits", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GOLDEN = _script()
CASES = GOLDEN.cases()


def _stored() -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN.GOLDEN))


def test_every_case_is_stored_for_the_oldest_jax() -> None:
    names = {k.split("/", 2)[2] for k in _stored() if k.startswith("0.10.2/cpu/")}
    assert names == set(CASES)
    assert len(CASES) == 16


# The mixtures of experts take over 3 s each eagerly (op by op, expert by expert).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("moe/")
                                  else n for n in sorted(CASES)])
def test_logits_are_bitwise_the_stored_ones(name: str) -> None:
    key = f"{GOLDEN.prefix()}/{name}"
    stored = _stored()
    if key not in stored:
        pytest.skip(f"no golden logits for {key} (stored: jaxlib/platform "
                    f"{sorted({k.rsplit('/', 1)[0].split('/')[0] for k in stored})})")
    got = GOLDEN.logits(CASES[name])
    want = stored[key]
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape == (1, 8, 128)
    diff = float(np.max(np.abs(got - want)))
    assert np.array_equal(got, want), f"{name}: max |difference| {diff:.3g}"
