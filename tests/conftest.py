import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import pytest


def needs_devices(n: int):
    """Skip a test when fewer than ``n`` devices exist (e.g. on a single real GPU)."""
    return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices")
