import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
# Eight simulated devices per test process, several processes on a few shared cores: a
# collective's threads can take longer than XLA's default wait to meet at the rendezvous
# (docs/architecture.md), which aborts the process. Wait longer; a real hang still ends.
if "--xla_cpu_collective_call_terminate_timeout_seconds" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += (" --xla_cpu_collective_call_terminate_timeout_seconds=600"
                                " --xla_cpu_collective_timeout_seconds=600")
# The tests compile hundreds of tiny programs and run each a few times, so LLVM's optimisation
# of the generated CPU code is about a third of their time and buys run speed no test measures.
# It changes neither the optimised HLO (shardings, collectives) nor XLA's memory figures, which
# tests/test_compile_level.py checks against a process at XLA's default level.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax
import pytest

# The fixture scripts run by hand in a separate venv with torch and transformers,
# which the project never imports: pytest (its doctest collection too) skips them.
# A second conftest.py under fixtures/ would shadow this one's `needs_devices`.
# The fixture scripts run by hand under torch/transformers, which the tests never import.
collect_ignore_glob = ["fixtures/make_*.py", "fixtures/check_*.py"]


def needs_devices(n: int):
    """Skip a test unless exactly ``n`` devices exist: on a single real GPU, or under
    another simulated count. Its meshes ("data=4,model=2") use every device, so a
    mesh of 8 is an error, not a smaller mesh, on 16 devices."""
    return pytest.mark.skipif(jax.device_count() != n,
                              reason=f"needs exactly {n} devices, found {jax.device_count()}")
