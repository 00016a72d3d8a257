import importlib.metadata
import os
import re

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
# The tests compile thousands of tiny programs and run each a few times, so most of their time
# is the CPU backend generating code, which buys run speed no test measures. The flags: LLVM's
# lowest optimisation level and one code-generation thread per program (the test workers already
# fill the cores); and, where XLA still has it (jaxlib <= 0.11.0), its older element-wise fusion
# emitter (the newer MLIR emitters cost twice as much to compile). jaxlib 0.11.1's XLA removed
# that flag (it aborts on a flag it does not know), and none of its CPU flags buys a measurable
# compile speed-up in its place (tried on 0.12: the xtile lowering, tiling propagation, the
# FAST_COMPILE preset, LLVM's expensive passes, XNNPACK), so there the first two are all. They
# cut a sharded training step's compile from ~3 s to ~0.5 s on jaxlib 0.10, from ~1.6 s to ~1 s
# on 0.12. The collectives, layouts, memory figures (temporaries within 1%) and, within float
# rounding, the numbers stay those of XLA's defaults: tests/test_compile_level.py checks it.
# jaxlib's version, read without importing jax: the flags must be set before it loads.
JAXLIB_VERSION = tuple(int(part) for part in
                       re.findall(r"\d+", importlib.metadata.version("jaxlib"))[:3])
COMPILE_SPEED_FLAGS = ("--xla_backend_optimization_level=0",
                       "--xla_cpu_parallel_codegen_split_count=1",
                       *(("--xla_cpu_use_fusion_emitters=false",) if JAXLIB_VERSION < (0, 11, 1) else ()))
os.environ["XLA_FLAGS"] += "".join(f" {flag}" for flag in COMPILE_SPEED_FLAGS
                                   if flag.split("=")[0] not in os.environ["XLA_FLAGS"])

import jax  # noqa: E402  (XLA_FLAGS must be set before jax loads)
import pytest  # noqa: E402

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
