"""Hostile batches for ``Trainer.fit``'s feed, which checks a group's structure and
leaves once per layout and then only stacks: what changes after the first group
(a structure, a shape, a Python number, text) is still named."""

from __future__ import annotations

from typing import Any


def build(hs: Any) -> None:
    import numpy as np

    F = hs.F
    x = np.ones((8, 2), np.float32)

    def fit(data: list[Any], num_steps: int = 4) -> Any:
        return F.fit(data=data, num_steps=num_steps)

    hs.api("fit_feed/structure_changes_in_a_group", ("batch", "structure"),
           lambda: fit([{"x": x, "y": x}, {"x": x}] * 2))
    def on_x(m: Any, b: Any) -> Any:
        import jax.numpy as jnp

        return jnp.mean((m(b["x"]) - 1.0) ** 2)

    hs.api("fit_feed/structure_changes_in_a_later_group", ("batch", "structure"),
           lambda: F.fit(F.trainer(on_x), data=[{"x": x}] * 3 + [{"x": x, "y": x}],
                         num_steps=4))
    hs.api("fit_feed/rows_change_in_a_later_group", ("batch", "shape"),
           lambda: fit([x, x, x, np.ones((4, 2), np.float32)]))
    hs.api("fit_feed/python_float_in_a_later_group", "batch",
           lambda: fit([x, x, 1.5, 2.5]))
    hs.api("fit_feed/text_in_a_later_group", "batch",
           lambda: fit([x, x, np.array(["a"] * 8), np.array(["b"] * 8)]))
    hs.api("fit_feed/empty_dict_batches", "batch", lambda: fit([{}] * 4))
    hs.api("fit_feed/lower_text_batch", "batch",
           lambda: F.trainer().lower(np.array([["a"] * 8] * 2)))
