# Simulated devices must be requested before jax is imported anywhere, including
# by the doctests collected from nnx_shard/, so the flag is set at the rootdir.
import os
import shutil
import tempfile

import pytest

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# One XLA compilation cache for the whole run, shared by the pytest-xdist workers (they
# inherit this process's environment): many tests compile the same programs (each
# worker its own cached one-device reference, the same tiny model under the same
# preset), and a program compiled once is read back instead of compiled again. It
# starts empty and is removed at the end, so every run compiles what it runs once.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="nnx-shard-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

    def pytest_unconfigure(config):
        shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the private examples named in ``tests/_tiers.py`` slow, and runs each docstring
    example once: ``tests/test_api_examples.py`` runs every example the API pages render in a
    fresh namespace (the stricter check: it must import what it uses); when it is part of the
    run, ``--doctest-modules`` keeps only the docstrings it does not cover (private helpers'
    examples)."""
    from _pytest.doctest import DoctestItem

    from tests._tiers import SLOW_DOCTESTS

    for item in items:
        if isinstance(item, DoctestItem) and item.name in SLOW_DOCTESTS:
            item.add_marker(pytest.mark.slow)
    if not any(item.nodeid.startswith("tests/test_api_examples.py::test_example_runs_as_written")
               for item in items):
        return
    import inspect

    from tests.test_api_examples import EXAMPLES

    covered = {inspect.cleandoc(doc) for doc in EXAMPLES.values()}
    kept, dropped = [], []
    for item in items:
        doc = item.dtest.docstring if isinstance(item, DoctestItem) else None
        (dropped if doc and inspect.cleandoc(doc) in covered else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
