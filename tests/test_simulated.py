"""The simulated-device children: long-lived :class:`Workers` and their failures.

The children here serve ``tests/_requests.py``, which needs no JAX: each starts in a few
hundredths of a second, so these run in the quick tier."""

from __future__ import annotations

import gc
import warnings

from nnx_shard._simulated import Workers, simulated_env


def test_workers_answer_every_request_in_long_lived_children():
    got: dict[int, dict] = {}
    with Workers("tests._requests:sleep_request", 2, size=2, timeout=60) as w:
        w.map([{"s": 0.0}] * 5, lambda i, r: got.update({i: r}))
        w.map([{"s": 0.0}] * 3, lambda i, r: got.update({10 + i: r}))
        assert w.started == 2  # the second map reuses the children of the first
    assert sorted(got) == [0, 1, 2, 3, 4, 10, 11, 12]
    assert len({r["pid"] for r in got.values()}) == 2


def test_a_slow_request_does_not_hold_the_others_back(tmp_path):
    # The slow request waits for a file written only once the three quick ones are
    # answered: held back, they never would be (the slow one would run out its 120 s).
    gate = tmp_path / "quick-ones-answered"
    order: list[int] = []

    def answered(i: int, r: dict) -> None:
        order.append(i)
        if sorted(order) == [1, 2, 3]:
            gate.touch()

    with Workers("tests._requests:sleep_request", 2, size=2, timeout=300) as w:
        w.map([{"s": 120.0, "gate": str(gate)}, {"s": 0.0}, {"s": 0.0}, {"s": 0.0}], answered)
    assert order[-1] == 0 and gate.exists()


def test_a_request_past_the_timeout_kills_its_child_and_the_next_gets_a_new_one():
    got: dict[int, dict] = {}
    with Workers("tests._requests:sleep_request", 2, size=1, timeout=1.0) as w:
        w.map([{"s": 0.0}], lambda i, r: got.update({0: r}))  # the start's 60 s grace used
        w.map([{"s": 30.0}, {"s": 0.0}], lambda i, r: got.update({1 + i: r}))
        assert w.started == 2
    assert got[1] == {"failed": "took longer than 1 s", "timed_out": True}
    assert got[2]["slept"] == 0.0 and got[2]["pid"] != got[0]["pid"]


def test_a_child_that_dies_reports_its_last_words_and_is_replaced():
    got: dict[int, dict] = {}
    with Workers("tests._requests:die_request", 2, size=1, timeout=60) as w:
        w.map([{"die": False}, {"die": True}, {"die": False}],
              lambda i, r: got.update({i: r}))
    assert got[1] == {"failed": "dying on purpose", "timed_out": False}
    assert got[0]["pid"] != got[2]["pid"]


def test_closed_workers_leave_no_pipe_open():
    # A pipe left open is a ResourceWarning when it is collected (nnx-shard plan --auto
    # printed them); a dead child's pipes are closed too.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Workers("tests._requests:die_request", 2, size=1, timeout=60) as w:
            w.map([{"die": False}, {"die": True}], lambda i, r: None)
        del w
        gc.collect()
    assert not [str(c.message) for c in caught if issubclass(c.category, ResourceWarning)]


def test_simulated_env_forces_the_device_count_and_keeps_other_flags():
    env = simulated_env(16, {"XLA_FLAGS": "--a=1 --xla_force_host_platform_device_count=8",
                             "JAX_NUM_CPU_DEVICES": "8"})
    assert env["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=16"
    assert "JAX_NUM_CPU_DEVICES" not in env and env["JAX_PLATFORMS"] == "cpu"
