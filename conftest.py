# Simulated devices must be requested before jax is imported anywhere, including
# by the doctests collected from nnx_shard/, so the flag is set at the rootdir.
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
