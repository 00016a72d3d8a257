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

import jax
import pytest

# The fixture scripts run by hand in a separate venv with torch and transformers,
# which the project never imports: pytest (its doctest collection too) skips them.
# A second conftest.py under fixtures/ would shadow this one's `needs_devices`.
collect_ignore = ["fixtures/make_hf.py", "fixtures/check_hf_reads.py"]


def needs_devices(n: int):
    """Skip a test unless exactly ``n`` devices exist: on a single real GPU, or under
    another simulated count. Its meshes ("data=4,model=2") use every device, so a
    mesh of 8 is an error, not a smaller mesh, on 16 devices."""
    return pytest.mark.skipif(jax.device_count() != n,
                              reason=f"needs exactly {n} devices, found {jax.device_count()}")


# Tests measured over ~10 s on 2 shared cores that carry no marker of their own: the slow
# tier with the ones marked in their files (`pytest -m slow`), kept out of the quick loop.
_SLOW = (
    "test_adapters.py::test_adapter_equals_stock_multi_head_attention",
    "test_blockwise.py::test_cross_attention_lengths",
    "test_checkpoint.py::test_resume_in_fresh_process_is_bitwise",
    "test_cli.py::test_demo_end_to_end",
    "test_cli.py::test_demo_of_one_step_runs",
    "test_cli.py::test_demo_without_matplotlib",
    "test_cli.py::test_plan_compiled_total_is_the_in_process_compile_of_the_same_step",
    "test_cli.py::test_plan_remat_policies_are_the_models_and_change_the_compiled_temp",
    "test_cli.py::test_plan_the_compiled_figure_decides_and_the_formula_is_labelled",
    "test_collective_matmul.py::test_async_tp_equals_tp_and_one_device",
    "test_collective_matmul.py::test_ops_keep_the_batch_split_over_data",
    "test_collective_matmul.py::test_projection_dispatch",
    "test_collective_matmul.py::test_trainer_carries_the_option",
    "test_compiled.py::test_subprocess_compiles_the_same_program_as_in_process",
    "test_distributed.py::test_checkpoint_written_by",
    "test_distributed.py::test_two_processes",
    "test_llama.py::test_scan_layers_equals_unrolled",
    "test_models.py::test_activation_formula_follows_the_kernel",
    "test_models.py::test_remat_lowers_scanned_temp_bytes",
    "test_notebooks.py::test_notebook_runs",
    "test_planner.py::test_compiled_costs_count_scanned_layers_once_per_layer",
    "test_readme.py::test_readme_python_blocks_run_as_written",
    "test_stock_layers.py::",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(name in item.nodeid for name in _SLOW):
            item.add_marker(pytest.mark.slow)
