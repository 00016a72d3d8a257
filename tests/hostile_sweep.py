"""A hostile sweep of nnx_shard's public API and the ``nnx-shard`` command.

Every case hands one public function (or the command) an invalid value: a wrong
type, a bool or None where a number goes, zero, a negative, NaN, a huge number,
an empty value, a hostile file. Each outcome is one of

* ``clear``: an exception of nnx_shard's family (``NnxShardError``), or a
  ``ValueError`` / ``TypeError`` / ``OSError`` raised by nnx_shard's own code,
  whose message names the argument (the case lists the words it may use) and is
  at most 2,000 characters; for the command, exit status 2 and one
  ``nnx-shard: error: ...`` line naming the flag;
* ``raw``: any other exception (one raised inside jax, flax, orbax, numpy or
  Python itself, a message that does not name the argument, an unbounded
  message), or a traceback from the command;
* ``hang``: the call did not finish within its time limit;
* ``silent``: the invalid value was accepted (the call returned normally, the
  command exited 0 or 1).

The API cases run in a worker subprocess (8 simulated CPU devices), one at a
time; a case that runs past its limit is recorded as a hang, the worker is
killed and a fresh one goes on with the next case. Command cases run there too,
through ``nnx_shard.cli.main`` (the console script's function); ``proc`` cases
run the real ``python -m nnx_shard.cli`` in a subprocess.

    python tests/hostile_sweep.py              # every case, a summary, the failures
    python tests/hostile_sweep.py --fast       # the cases tests/test_hostile_sweep.py runs
    python tests/hostile_sweep.py --json out.json --show all

Nothing here runs on import (pytest imports every module of tests/ for doctests).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CLEAR, RAW, HANG, SILENT = "clear", "raw", "hang", "silent"
MAX_MESSAGE = 2000
# Per case, once the worker is up (its start, importing JAX, is not counted): generous,
# since a shared machine can run ten times slower than an idle one.
FAST_TIMEOUT = float(os.environ.get("HOSTILE_TIMEOUT", "90"))
SLOW_TIMEOUT = 4 * FAST_TIMEOUT


@dataclasses.dataclass(frozen=True)
class Case:
    """One hostile call: ``fn`` (API), ``argv`` (the command), what its error must name."""

    name: str
    names: tuple[str, ...]
    fn: Callable[[], Any] | None = None
    argv: tuple[str, ...] | None = None
    kind: str = "api"  # api | cli (in the worker) | proc (a real subprocess)
    slow: bool = False


CASES: list[Case] = []


def _names(arg: str | Sequence[str]) -> tuple[str, ...]:
    return (arg,) if isinstance(arg, str) else tuple(arg)


def api(name: str, arg: str | Sequence[str], fn: Callable[[], Any], *, slow: bool = False) -> None:
    CASES.append(Case(name, _names(arg), fn=fn, slow=slow))


def cli(name: str, arg: str | Sequence[str], *argv: str, slow: bool = False) -> None:
    CASES.append(Case(name, _names(arg), argv=argv, kind="cli", slow=slow))


def proc(name: str, arg: str | Sequence[str], *argv: str) -> None:
    CASES.append(Case(name, _names(arg), argv=argv, kind="proc", slow=True))


NAN, INF = float("nan"), float("inf")


# -- fixtures (built in the worker, on first use) ------------------------------------------


class _Fixtures:
    """Tiny models, optimizers, meshes and files the cases use, built lazily."""

    def __init__(self) -> None:
        self._tmp: str | None = None

    @property
    def tmp(self) -> str:
        if self._tmp is None:  # under the sweep's own folder, removed when it ends
            self._tmp = tempfile.mkdtemp(prefix="cases_", dir=os.environ.get("HOSTILE_TMP"))
        return self._tmp

    def path(self, name: str) -> str:
        return os.path.join(self.tmp, name)

    def file(self, name: str, content: str | bytes) -> str:
        p = self.path(name)
        with open(p, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
        return p

    def fifo(self, name: str) -> str:
        p = self.path(name)
        if not os.path.exists(p):
            os.mkfifo(p)
        return p

    def dir(self, name: str) -> str:
        p = self.path(name)
        os.makedirs(p, exist_ok=True)
        return p

    def model(self) -> Any:
        from flax import nnx

        return nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    def opt(self, model: Any = None) -> Any:
        import optax
        from flax import nnx

        return nnx.Optimizer(model if model is not None else self.model(), optax.sgd(0.1),
                             wrt=nnx.Param)

    @staticmethod
    def mse(m: Any, b: Any) -> Any:
        import jax.numpy as jnp

        return jnp.mean((m(b) - 1.0) ** 2)

    def trainer(self, loss: Any = None, **kw: Any) -> Any:
        import nnx_shard as ns

        model = self.model()
        kw.setdefault("steps_per_call", 2)
        return ns.Trainer(model, self.opt(model), loss or self.mse, mesh="data=8",
                          rules={"batch": "data"}, **kw)

    def data(self, n: int = 4) -> list[Any]:
        import numpy as np

        return [np.ones((8, 2), np.float32)] * n

    def fit(self, trainer: Any = None, data: Any = "default", num_steps: Any = 2,
            **kw: Any) -> Any:
        trainer = trainer or self.trainer()
        kw.setdefault("progress", False)
        return trainer.fit(self.data() if isinstance(data, str) and data == "default" else data,
                           num_steps, **kw)

    def mesh(self, spec: str = "data=8") -> Any:
        import nnx_shard as ns

        return ns.make_mesh(spec)

    def saved(self) -> str:
        """A directory with one finished checkpoint (step 1) of :meth:`model`."""
        import nnx_shard as ns

        d = self.path("saved_ckpt")
        if not os.path.isdir(d):
            model = self.model()
            ns.save(d, 1, model=model, optimizer=self.opt(model))
        return d

    def rules_file(self, name: str, text: str | bytes) -> str:
        return self.file(name, text)


F = _Fixtures()


# -- the cases --------------------------------------------------------------------------------


def _build_cases() -> None:
    import numpy as np

    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    def jnp() -> Any:
        import jax.numpy

        return jax.numpy

    # make_mesh ------------------------------------------------------------------------------
    mesh_bad: list[tuple[str, Any, Sequence[str]]] = [
        ("none", None, "spec"), ("int", 8, "spec"), ("float", 8.5, "spec"),
        ("bool", True, "spec"), ("bytes", b"data=8", "spec"), ("empty", "", "spec"),
        ("no_size", "data", "data"), ("zero", "data=0", "data"), ("neg", "data=-2", "data"),
        ("frac", "data=1.5", "data"), ("nan", "data=nan", "data"), ("inf", "data=inf", "data"),
        ("huge_text", "data=" + "9" * 30, "data"), ("dict_zero", {"data": 0}, "data"),
        ("dict_neg", {"data": -3}, "data"), ("dict_float", {"data": 8.0}, "data"),
        ("dict_bool", {"data": True}, "data"), ("dict_nan", {"data": NAN}, "data"),
        ("dict_none", {"data": None}, "data"), ("dict_empty_name", {"": 8}, "axis"),
        ("dict_int_name", {1: 8}, "axis"), ("twice", "data=4,data=2", "data"),
        ("two_minus_one", "data=-1,model=-1", "-1"), ("too_many", "data=16", ("16", "devices")),
        ("not_dividing", "data=3", ("3", "devices")), ("dict_huge", {"data": 10**30}, "data"),
        ("empty_dict", {}, ("axes", "spec")), ("list", ["data", 8], "spec"),
    ]
    for label, spec, arg in mesh_bad:
        api(f"make_mesh/{label}", arg, lambda spec=spec: ns().make_mesh(spec))
    api("make_mesh/axis_types_bogus", "axis_types",
        lambda: ns().make_mesh("data=8", axis_types="bogus"))
    api("make_mesh/axis_types_int", "axis_types", lambda: ns().make_mesh("data=8", axis_types=5))
    api("make_mesh/axis_types_list_of_int", "axis_types",
        lambda: ns().make_mesh("data=8", axis_types=[1]))
    api("make_mesh/axis_types_wrong_count", "axis_types",
        lambda: ns().make_mesh("data=4,model=2", axis_types=[__import__("jax").sharding.AxisType.Auto]))
    api("make_mesh/devices_empty", "devices", lambda: ns().make_mesh("data=8", devices=[]))
    api("make_mesh/devices_str", "devices", lambda: ns().make_mesh("data=8", devices="cpu"))
    api("make_mesh/devices_ints", "devices", lambda: ns().make_mesh("data=2", devices=[1, 2]))
    api("make_mesh/devices_twice", "devices", lambda: ns().make_mesh(
        "data=2", devices=[__import__("jax").devices()[0]] * 2))

    # Rules(...) -------------------------------------------------------------------------------
    rules_bad: list[tuple[str, Callable[[], Any], Sequence[str]]] = [
        ("int", lambda: ns().Rules(5), "Rules"),
        ("str", lambda: ns().Rules("data"), "Rules"),
        ("bytes", lambda: ns().Rules(b"x"), "Rules"),
        ("int_name", lambda: ns().Rules({5: "data"}), "logical"),
        ("empty_name", lambda: ns().Rules({"": "data"}), "logical"),
        ("none_name", lambda: ns().Rules({None: "data"}), "logical"),
        ("int_value", lambda: ns().Rules({"a": 5}), "rule"),
        ("empty_value", lambda: ns().Rules({"a": ""}), "rule"),
        ("empty_list", lambda: ns().Rules({"a": []}), "rule"),
        ("axis_twice", lambda: ns().Rules({"a": ("x", "x")}), "rule"),
        ("int_in_product", lambda: ns().Rules({"a": ("x", 5)}), "rule"),
        ("dict_value", lambda: ns().Rules({"a": {"b": 1}}), "rule"),
        ("nan_value", lambda: ns().Rules({"a": NAN}), "rule"),
        ("short_pair", lambda: ns().Rules([("a",)]), "entry"),
        ("long_pair", lambda: ns().Rules([("a", "b", "c")]), "entry"),
        ("int_entry", lambda: ns().Rules([5]), "entry"),
        ("indivisible_bogus", lambda: ns().Rules({}, indivisible="x"), "indivisible"),
        ("indivisible_bool", lambda: ns().Rules({}, indivisible=True), "indivisible"),
        ("options_int", lambda: ns().Rules({}, options=5), "options"),
        ("options_typo", lambda: ns().Rules({}, options={"atention": "ring"}), "atention"),
        ("options_int_key", lambda: ns().Rules({}, options={1: "x"}), "option"),
        ("options_unhashable", lambda: ns().Rules({}, options={"attention": []}), "attention"),
        ("with_options_typo", lambda: ns().Rules({}).with_options(atention="ring"), "atention"),
        ("with_options_unknown", lambda: ns().Rules({}).with_options(pipelin=1), "pipelin"),
        ("or_typo_options", lambda: ns().Rules({}) | ns().Rules({}, options={"colective": 1}),
         "colective"),
        ("huge_repr_value", lambda: ns().Rules({"a": ("x" * 10**6, 5)}), "rule"),
        ("from_pairs_int", lambda: ns().Rules.from_pairs(5), "from_pairs"),
        ("from_pairs_str", lambda: ns().Rules.from_pairs("ab"), "from_pairs"),
        ("from_pairs_dict", lambda: ns().Rules.from_pairs({"a": "b"}), "from_pairs"),
        ("from_pairs_short", lambda: ns().Rules.from_pairs([["a"]]), "entry"),
        ("from_pairs_int_value", lambda: ns().Rules.from_pairs([["a", 5]]), "rule"),
        ("from_pairs_int_name", lambda: ns().Rules.from_pairs([[5, "a"]]), "logical"),
        ("from_pairs_twice", lambda: ns().Rules.from_pairs([["a", ["x", "x"]]]), "rule"),
        ("from_pairs_indivisible", lambda: ns().Rules.from_pairs([], indivisible=3),
         "indivisible"),
    ]
    for label, fn, arg in rules_bad:
        api(f"Rules/{label}", arg, fn)

    r = lambda: ns().Rules({"embed": None, "mlp": "model", "batch": "data"})  # noqa: E731
    spec_bad: list[tuple[str, Callable[[], Any], Sequence[str]]] = [
        ("names_str", lambda: r().spec("embed"), "logical axes"),
        ("names_int", lambda: r().spec(5), "logical axes"),
        ("names_int_entry", lambda: r().spec((5,)), "entry"),
        ("names_empty_entry", lambda: r().spec(("",)), "entry"),
        ("names_unknown", lambda: r().spec(("nope",)), "nope"),
        ("rank_mismatch", lambda: r().spec(("mlp",), shape=(4, 4)), "rank"),
        ("shape_neg", lambda: r().spec(("mlp",), shape=(-4,), mesh={"model": 2}), "shape"),
        ("shape_float", lambda: r().spec(("mlp",), shape=(4.5,), mesh={"model": 2}), "shape"),
        ("shape_nan", lambda: r().spec(("mlp",), shape=(NAN,), mesh={"model": 2}), "shape"),
        ("shape_bool", lambda: r().spec(("mlp",), shape=(True,), mesh={"model": 2}), "shape"),
        ("shape_str", lambda: r().spec(("mlp",), shape="4", mesh={"model": 2}), "shape"),
        ("shape_none_dim", lambda: r().spec(("mlp",), shape=(None,), mesh={"model": 2}),
         "shape"),
        ("mesh_zero", lambda: r().spec(("mlp",), shape=(4,), mesh={"model": 0}), "mesh"),
        ("mesh_neg", lambda: r().spec(("mlp",), shape=(4,), mesh={"model": -2}), "mesh"),
        ("mesh_nan", lambda: r().spec(("mlp",), shape=(4,), mesh={"model": NAN}), "mesh"),
        ("mesh_float", lambda: r().spec(("mlp",), shape=(4,), mesh={"model": 2.5}), "mesh"),
        ("mesh_bool", lambda: r().spec(("mlp",), shape=(4,), mesh={"model": True}), "mesh"),
        ("mesh_int", lambda: r().spec(("mlp",), shape=(4,), mesh=5), "mesh"),
        ("mesh_str", lambda: r().spec(("mlp",), shape=(4,), mesh="model=2"), "mesh"),
        ("mesh_none_size", lambda: r().spec(("mlp",), shape=(4,), mesh={"model": None}), "mesh"),
        ("not_divisible", lambda: r().spec(("mlp",), shape=(3,), mesh={"model": 2}), "mlp"),
        ("missing_axis", lambda: r().spec(("mlp",), shape=(4,), mesh={"data": 2}), "model"),
    ]
    for label, fn, arg in spec_bad:
        api(f"Rules.spec/{label}", arg, fn)

    # Rules.from_file ----------------------------------------------------------------------------
    bomb = ('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
            'b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n'
            'd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n'
            'f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\ng: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n'
            'h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]\ni: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]\n')
    deep = "[" * 100_000 + "]" * 100_000
    big_value = json.dumps({"a": ["x" * 500_000, 7]})
    file_bad: list[tuple[str, Callable[[], Any], Sequence[str]]] = [
        ("none", lambda: ns().Rules.from_file(None), "path"),
        ("bytes", lambda: ns().Rules.from_file(b"rules.json"), "path"),
        ("int", lambda: ns().Rules.from_file(5), "path"),
        ("missing", lambda: ns().Rules.from_file(F.path("nope.json")), "rules file"),
        ("directory", lambda: ns().Rules.from_file(F.dir("d.json")), "rules file"),
        ("fifo", lambda: ns().Rules.from_file(F.fifo("fifo.json")), "rules file"),
        ("dev_zero", lambda: ns().Rules.from_file(_link("zero.json", "/dev/zero")),
         "rules file"),
        ("dev_null_yaml", lambda: ns().Rules.from_file(_link("null.yaml", "/dev/null")),
         "rules file"),
        ("suffix", lambda: ns().Rules.from_file(F.file("r.txt", "{}")), "rules file"),
        ("binary_json", lambda: ns().Rules.from_file(F.file("bin.json", b"\xff\xfe\x00\x81")),
         "rules file"),
        ("bad_utf8_yaml", lambda: ns().Rules.from_file(F.file("bad.yaml", b"a: \xff\xfe\n")),
         "rules file"),
        ("bad_utf8_toml", lambda: ns().Rules.from_file(F.file("bad.toml", b'a = "\xff"\n')),
         "rules file"),
        ("nul_json", lambda: ns().Rules.from_file(F.file("nul.json", '{"a": "\x00"}')),
         ("rules file", "rule")),
        ("deep_json", lambda: ns().Rules.from_file(F.file("deep.json", deep)), "rules file"),
        ("deep_yaml", lambda: ns().Rules.from_file(F.file("deep.yaml", deep)), "rules file"),
        ("yaml_bomb", lambda: ns().Rules.from_file(F.file("bomb.yaml", bomb)), "rules file"),
        ("yaml_python_tag", lambda: ns().Rules.from_file(
            F.file("tag.yaml", "a: !!python/object/apply:os.getcwd []\n")), "rules file"),
        ("json_dup_keys", lambda: ns().Rules.from_file(
            F.file("dup.json", '{"mlp": "model", "mlp": "data"}')), ("rules file", "mlp")),
        ("yaml_dup_keys", lambda: ns().Rules.from_file(
            F.file("dup.yaml", "mlp: model\nmlp: data\n")), ("rules file", "mlp")),
        ("yaml_dup_nested", lambda: ns().Rules.from_file(
            F.file("dup2.yaml", "rules:\n  mlp: model\n  mlp: data\n")), ("rules file", "mlp")),
        ("toml_dup_keys", lambda: ns().Rules.from_file(
            F.file("dup.toml", 'mlp = "model"\nmlp = "data"\n')), ("rules file", "mlp")),
        ("empty_json", lambda: ns().Rules.from_file(F.file("empty.json", "")), "rules file"),
        ("empty_yaml", lambda: ns().Rules.from_file(F.file("empty.yaml", "")), "rules file"),
        ("json_number", lambda: ns().Rules.from_file(F.file("num.json", "5")), "rules file"),
        ("json_nan", lambda: ns().Rules.from_file(F.file("nan.json", '{"a": NaN}')),
         ("rules file", "rule")),
        ("rules_int", lambda: ns().Rules.from_file(F.file("ri.json", '{"rules": 5}')),
         "rules file"),
        ("both_keys", lambda: ns().Rules.from_file(
            F.file("both.json", '{"rules": {}, "logical_axis_rules": []}')), "rules file"),
        ("indivisible_bogus", lambda: ns().Rules.from_file(
            F.file("ind.json", '{"indivisible": "x", "a": null}')), "indivisible"),
        ("huge_value_message", lambda: ns().Rules.from_file(F.file("big.json", big_value)),
         "rule"),
        ("huge_file", lambda: ns().Rules.from_file(
            F.file("huge.json", '{"a": "' + "x" * (70 << 20) + '"}')), "rules file"),
    ]
    for label, fn, arg in file_bad:
        api(f"Rules.from_file/{label}", arg, fn)

    # the trainer ----------------------------------------------------------------------------
    for label, kw, arg in [
        ("steps_per_call_zero", {"steps_per_call": 0}, "steps_per_call"),
        ("steps_per_call_neg", {"steps_per_call": -1}, "steps_per_call"),
        ("steps_per_call_true", {"steps_per_call": True}, "steps_per_call"),
        ("steps_per_call_float", {"steps_per_call": 1.5}, "steps_per_call"),
        ("steps_per_call_none", {"steps_per_call": None}, "steps_per_call"),
        ("steps_per_call_nan", {"steps_per_call": NAN}, "steps_per_call"),
        ("steps_per_call_str", {"steps_per_call": "2"}, "steps_per_call"),
        ("microbatches_zero", {"microbatches": 0}, "microbatches"),
        ("microbatches_neg", {"microbatches": -2}, "microbatches"),
        ("microbatches_true", {"microbatches": True}, "microbatches"),
        ("microbatches_float", {"microbatches": 2.0}, "microbatches"),
        ("microbatches_none", {"microbatches": None}, "microbatches"),
        ("unroll_zero", {"unroll": 0}, "unroll"),
        ("unroll_true", {"unroll": True}, "unroll"),
        ("unroll_float", {"unroll": 1.5}, "unroll"),
        ("batch_names_int", {"batch_names": 5}, "batch_names"),
        ("batch_names_str", {"batch_names": "batch"}, "batch_names"),
        ("batch_names_int_entry", {"batch_names": (5,)}, "batch_names"),
        ("batch_names_empty", {"batch_names": ()}, "batch_names"),
        ("has_aux_str", {"has_aux": "yes"}, "has_aux"),
        ("has_aux_none", {"has_aux": None}, "has_aux"),
        ("donate_str", {"donate": "no"}, "donate"),
        ("donate_int", {"donate": 2}, "donate"),
    ]:
        api(f"Trainer/{label}", arg, lambda kw=kw: F.trainer(**kw))
    api("Trainer/model_int", "model", lambda: ns().Trainer(5, F.opt(), F.mse, mesh="data=8",
                                                           rules={"batch": "data"}))
    api("Trainer/optimizer_tx", "optimizer", lambda: ns().Trainer(
        F.model(), __import__("optax").sgd(0.1), F.mse, mesh="data=8", rules={"batch": "data"}))
    api("Trainer/loss_int", "loss_fn", lambda: ns().Trainer(
        F.model(), F.opt(), 5, mesh="data=8", rules={"batch": "data"}))
    api("Trainer/mesh_none", ("mesh", "spec"), lambda: ns().Trainer(
        F.model(), F.opt(), F.mse, mesh=None, rules={"batch": "data"}))
    api("Trainer/mesh_zero", ("mesh", "data"), lambda: ns().Trainer(
        F.model(), F.opt(), F.mse, mesh="data=0", rules={"batch": "data"}))
    api("Trainer/rules_int", "Rules", lambda: ns().Trainer(
        F.model(), F.opt(), F.mse, mesh="data=8", rules=5))

    fit_bad: list[tuple[str, Callable[[], Any], Sequence[str]]] = [
        ("num_steps_neg", lambda: F.fit(num_steps=-1), "num_steps"),
        ("num_steps_true", lambda: F.fit(num_steps=True), "num_steps"),
        ("num_steps_float", lambda: F.fit(num_steps=2.0), "num_steps"),
        ("num_steps_none", lambda: F.fit(num_steps=None), "num_steps"),
        ("num_steps_nan", lambda: F.fit(num_steps=NAN), "num_steps"),
        ("num_steps_str", lambda: F.fit(num_steps="2"), "num_steps"),
        ("data_none", lambda: F.fit(data=None), "data"),
        ("data_int", lambda: F.fit(data=5), "data"),
        ("data_str", lambda: F.fit(data="abc"), "data"),
        ("callbacks_int", lambda: F.fit(callbacks=5), "callbacks"),
        ("callbacks_list_int", lambda: F.fit(callbacks=[5]), "callbacks"),
        ("callbacks_str", lambda: F.fit(callbacks="cb"), "callbacks"),
        ("callbacks_none_entry", lambda: F.fit(callbacks=[None]), "callbacks"),
        ("checkpointer_str", lambda: F.fit(checkpointer=F.path("ck_str")), "checkpointer"),
        ("checkpointer_int", lambda: F.fit(checkpointer=5), "checkpointer"),
        ("resume_str", lambda: F.fit(resume="yes"), "resume"),
        ("resume_no_checkpointer", lambda: F.fit(resume=True), "resume"),
        ("progress_str", lambda: F.fit(progress="yes"), "progress"),
        ("batch_rows_not_dividing", lambda: F.fit(
            data=[np.ones((7, 2), np.float32)] * 4), ("batch", "7")),
        ("batch_strings", lambda: F.fit(data=[np.array(["a"] * 8)] * 4), "batch"),
        ("batch_object", lambda: F.fit(data=[object()] * 4), "batch"),
        ("batch_shapes_change", lambda: F.fit(
            data=[np.ones((8, 2), np.float32), np.ones((16, 2), np.float32)] * 2,
            num_steps=4), "batch"),
        ("aux_named_loss", lambda: F.fit(F.trainer(_aux_loss({"loss": 123.0}), has_aux=True)),
         ("loss", "aux")),
        ("aux_named_grad_norm", lambda: F.fit(F.trainer(_aux_loss({"grad_norm": 1.0}),
                                                        has_aux=True)), ("grad_norm", "aux")),
        ("aux_named_step", lambda: F.fit(F.trainer(_aux_loss({"step": 1.0}), has_aux=True)),
         ("step", "aux")),
        ("aux_named_applied", lambda: F.fit(F.trainer(_aux_loss({"applied": 1.0}),
                                                      has_aux=True)), ("applied", "aux")),
        ("aux_str_value", lambda: F.fit(F.trainer(_aux_loss({"tag": "x"}), has_aux=True)),
         ("aux", "tag", "metrics")),
        ("loss_vector", lambda: F.fit(F.trainer(lambda m, b: (m(b) - 1.0) ** 2)), "loss"),
        ("loss_int", lambda: F.fit(F.trainer(lambda m, b: 3)), "loss"),
        ("loss_returns_tuple_without_has_aux", lambda: F.fit(
            F.trainer(_aux_loss({"a": 1.0}))), ("loss", "has_aux")),
        ("has_aux_but_scalar", lambda: F.fit(F.trainer(F.mse, has_aux=True)),
         ("has_aux", "loss")),
    ]
    for label, fn, arg in fit_bad:
        api(f"Trainer.fit/{label}", arg, fn)
    api("Trainer.lower/batch_int", "batch", lambda: F.trainer().lower(5))

    # multistep, value_and_grad, shard_batch ----------------------------------------------------
    def step(model: Any, opt: Any, batch: Any) -> Any:
        loss, grads = ns().value_and_grad(F.mse)(model, batch)
        opt.update(model, grads)
        return {"loss": loss}

    def fused_call(batch: Any, **kw: Any) -> Any:
        model = F.model()
        with ns().use("data=8", {"batch": "data"}):
            return ns().multistep(step, **kw)(model, F.opt(model), batch)

    for label, kw, arg in [
        ("microbatches_zero", {"microbatches": 0}, "microbatches"),
        ("microbatches_true", {"microbatches": True}, "microbatches"),
        ("microbatches_neg", {"microbatches": -1}, "microbatches"),
        ("microbatches_float", {"microbatches": 2.0}, "microbatches"),
        ("max_in_flight_zero", {"max_in_flight": 0}, "max_in_flight"),
        ("max_in_flight_true", {"max_in_flight": True}, "max_in_flight"),
        ("unroll_zero", {"unroll": 0}, "unroll"),
        ("unroll_true", {"unroll": True}, "unroll"),
        ("donate_str", {"donate": "yes"}, "donate"),
    ]:
        api(f"multistep/{label}", arg, lambda kw=kw: ns().multistep(step, **kw))
    api("multistep/step_int", "step", lambda: ns().multistep(5))
    api("multistep/batch_without_steps_axis", ("K", "steps"), lambda: fused_call(
        ns().shard_batch(np.ones((8, 2), np.float32), "data=8", {"batch": "data"})))
    api("multistep/batch_steps_disagree", ("K", "steps"), lambda: fused_call(
        {"a": np.ones((2, 8, 2), np.float32), "b": np.ones((3, 8, 2), np.float32)}))
    api("multistep/scalar_batch", ("K", "steps"), lambda: fused_call(np.float32(1.0)))
    api("multistep/no_node", "NNX", lambda: ns().multistep(step)(1, 2, np.ones((2, 8, 2))))
    for label, kw, arg in [
        ("microbatches_zero", {"microbatches": 0}, "microbatches"),
        ("microbatches_true", {"microbatches": True}, "microbatches"),
        ("microbatches_neg", {"microbatches": -3}, "microbatches"),
        ("microbatches_float", {"microbatches": 2.5}, "microbatches"),
        ("has_aux_str", {"has_aux": "x"}, "has_aux"),
    ]:
        api(f"value_and_grad/{label}", arg, lambda kw=kw: ns().value_and_grad(F.mse, **kw))
    api("value_and_grad/loss_int", "loss_fn", lambda: ns().value_and_grad(5))
    api("value_and_grad/microbatches_not_dividing", "microbatches",
        lambda: ns().value_and_grad(F.mse, microbatches=3)(F.model(), np.ones((8, 2))))
    sb = lambda *a, **k: ns().shard_batch(*a, **k)  # noqa: E731
    for label, fn, arg in [
        ("batch_int", lambda: sb(5, "data=8", {"batch": "data"}), "batch"),
        ("batch_str", lambda: sb("abc", "data=8", {"batch": "data"}), "batch"),
        ("batch_objects", lambda: sb([object()], "data=8", {"batch": "data"}), "batch"),
        ("rows_not_dividing", lambda: sb(np.ones((7, 2)), "data=8", {"batch": "data"}),
         ("batch", "7")),
        ("names_int", lambda: sb(np.ones((8, 2)), "data=8", {"batch": "data"}, 5), "names"),
        ("steps_str", lambda: sb(np.ones((2, 8, 2)), "data=8", {"batch": "data"},
                                 steps="yes"), "steps"),
        ("steps_no_axis", lambda: sb(np.ones((8,)), "data=8", {"batch": "data"}, steps=True),
         ("steps", "K")),
        ("mesh_bad", lambda: sb(np.ones((8, 2)), "data=0", {"batch": "data"}), "data"),
        ("rules_bad", lambda: sb(np.ones((8, 2)), "data=8", 5), "Rules"),
        ("names_unknown", lambda: sb(np.ones((8, 2)), "data=8", {"batch": "data"},
                                     ("batchh",)), "batchh"),
    ]:
        api(f"shard_batch/{label}", arg, fn)

    # init, optimizer, explain, shardings, annotate -----------------------------------------------
    def lin() -> Any:
        from flax import nnx

        return nnx.Linear(4, 8, kernel_init=ns().with_logical(
            nnx.initializers.lecun_normal(), ("embed", "mlp")), rngs=nnx.Rngs(0))

    good_rules = {"embed": None, "mlp": "model", "batch": "data"}
    for label, fn, arg in [
        ("factory_int", lambda: ns().sharded_init(5, "data=4,model=2", good_rules), "factory"),
        ("factory_module", lambda: ns().sharded_init(lin(), "data=4,model=2", good_rules),
         "factory"),
        ("factory_returns_int", lambda: ns().sharded_init(lambda: 5, "data=4,model=2",
                                                          good_rules), "factory"),
        ("factory_raises", lambda: ns().sharded_init(lambda: 1 / 0, "data=4,model=2",
                                                     good_rules), "factory"),
        ("mesh_bad", lambda: ns().sharded_init(lin, "data=0", good_rules), "data"),
        ("rules_int", lambda: ns().sharded_init(lin, "data=4,model=2", 5), "Rules"),
        ("rule_missing", lambda: ns().sharded_init(lin, "data=4,model=2", {"embed": None}),
         "mlp"),
        ("not_divisible", lambda: ns().sharded_init(
            lin, "data=1,model=8", {**good_rules, "embed": "model"}), "embed"),
    ]:
        api(f"sharded_init/{label}", arg, fn)
        if label in ("factory_int", "factory_returns_int", "rules_int", "mesh_bad"):
            api(f"abstract_init/{label}", arg,
                lambda fn=fn: _swap(fn, "sharded_init", "abstract_init"))
    api("sharded_optimizer/model_int", "model", lambda: ns().sharded_optimizer(
        5, __import__("optax").sgd(0.1), "data=8", good_rules))
    api("sharded_optimizer/tx_str", ("tx", "optimizer"), lambda: ns().sharded_optimizer(
        F.model(), "adam", "data=8", good_rules))
    api("sharded_optimizer/tx_none", ("tx", "optimizer"), lambda: ns().sharded_optimizer(
        F.model(), None, "data=8", good_rules))
    api("sharded_optimizer/opt_rules_int", ("opt_rules", "Rules"), lambda: ns().sharded_optimizer(
        F.model(), __import__("optax").sgd(0.1), "data=8", good_rules, opt_rules=5))
    for label, fn, arg in [
        ("model_int", lambda: ns().explain(5, "data=8", good_rules), "model"),
        ("mesh_int", lambda: ns().explain(lin(), 5, good_rules), ("mesh", "spec")),
        ("mesh_zero", lambda: ns().explain(lin(), {"data": 0}, good_rules), ("mesh", "data")),
        ("mesh_nan", lambda: ns().explain(lin(), {"data": NAN}, good_rules), ("mesh", "data")),
        ("rules_int", lambda: ns().explain(lin(), "data=8", 5), "Rules"),
        ("optimizer_str", lambda: ns().explain(lin(), "data=8", good_rules, "adam"),
         "optimizer"),
        ("rule_missing", lambda: ns().explain(lin(), "data=8", {"embed": None}), "mlp"),
    ]:
        api(f"explain/{label}", arg, fn)
    for label, fn, arg in [
        ("mesh_str", lambda: ns().shardings(lin(), "data=8", good_rules), "mesh"),
        ("tree_int", lambda: ns().shardings(5, F.mesh(), good_rules), "tree"),
        ("rules_int", lambda: ns().shardings(lin(), F.mesh(), 5), "Rules"),
    ]:
        api(f"shardings/{label}", arg, fn)
    for label, fn, arg in [
        ("model_int", lambda: ns().annotate(5, {"kernel": ("embed", "mlp")}), "model"),
        ("patterns_int", lambda: ns().annotate(F.model(), 5), "patterns"),
        ("pattern_names_str", lambda: ns().annotate(F.model(), {"kernel": "embed"}), "kernel"),
        ("pattern_rank", lambda: ns().annotate(F.model(), {"kernel": ("embed",)}), "kernel"),
        ("pattern_no_match_strict", lambda: ns().annotate(F.model(), {"nope": ("a", "b")},
                                                          strict=True), "nope"),
        ("pattern_bad_regex", lambda: ns().annotate(F.model(), {"(": ("a", "b")}), "("),
        ("strict_str", lambda: ns().annotate(F.model(), {"kernel": ("a", "b")},
                                             strict="yes"), "strict"),
        ("with_logical_int", lambda: ns().with_logical(5, ("a",)), "initializer"),
        ("with_logical_names_str", lambda: ns().with_logical(
            __import__("flax").nnx.initializers.zeros, "embed"), ("names", "logical axes")),
        ("with_logical_names_int", lambda: ns().with_logical(
            __import__("flax").nnx.initializers.zeros, (5,)), "names"),
        ("logical_axes_str", lambda: ns().logical_axes(kernel="embed"), "kernel"),
        ("logical_axes_int", lambda: ns().logical_axes(kernel=5), "kernel"),
        ("get_logical_axes_int", lambda: ns().get_logical_axes(5), "tree"),
        ("constrain_names_str", lambda: _under(lambda: ns().constrain(
            jnp().ones((8, 4)), "batch")), "logical axes"),
        ("constrain_rank", lambda: _under(lambda: ns().constrain(jnp().ones((8, 4)),
                                                                  ("batch",))), "rank"),
        ("constrain_x_str", lambda: _under(lambda: ns().constrain("x", ("batch",))), "x"),
        ("use_mesh_bad", lambda: _enter(ns().use("data=0", good_rules)), "data"),
        ("use_rules_int", lambda: _enter(ns().use("data=8", 5)), "Rules"),
    ]:
        api(f"annotate/{label}", arg, fn)

    # checkpoints ----------------------------------------------------------------------------------
    ck = lambda *a, **k: ns().Checkpointer(*a, **k)  # noqa: E731
    for label, fn, arg in [
        ("dir_none", lambda: ck(None), "directory"),
        ("dir_empty", lambda: ck(""), "directory"),
        ("dir_int", lambda: ck(5), "directory"),
        ("dir_bytes", lambda: ck(b"ckpt"), "directory"),
        ("dir_is_file", lambda: ck(F.file("afile", "x")), "directory"),
        ("every_zero", lambda: ck(F.path("c1"), every=0), "every"),
        ("every_neg", lambda: ck(F.path("c1"), every=-1), "every"),
        ("every_true", lambda: ck(F.path("c1"), every=True), "every"),
        ("every_float", lambda: ck(F.path("c1"), every=1.5), "every"),
        ("every_none", lambda: ck(F.path("c1"), every=None), "every"),
        ("every_nan", lambda: ck(F.path("c1"), every=NAN), "every"),
        ("keep_zero", lambda: ck(F.path("c1"), keep=0), "keep"),
        ("keep_neg", lambda: ck(F.path("c1"), keep=-1), "keep"),
        ("keep_true", lambda: ck(F.path("c1"), keep=True), "keep"),
        ("keep_float", lambda: ck(F.path("c1"), keep=2.0), "keep"),
        ("async_save_str", lambda: ck(F.path("c1"), async_save="yes"), "async_save"),
        ("should_save_true", lambda: ck(F.path("c2"), every=1).should_save(True), "step"),
        ("should_save_str", lambda: ck(F.path("c2"), every=1).should_save("3"), "step"),
    ]:
        api(f"Checkpointer/{label}", arg, fn)
    sv = lambda d, step, **k: ns().save(d, step, **k)  # noqa: E731
    for label, fn, arg in [
        ("dir_none", lambda: sv(None, 1, model=F.model()), "directory"),
        ("dir_empty", lambda: sv("", 1, model=F.model()), "directory"),
        ("step_neg", lambda: sv(F.path("s1"), -1, model=F.model()), "step"),
        ("step_true", lambda: sv(F.path("s1"), True, model=F.model()), "step"),
        ("step_float", lambda: sv(F.path("s1"), 1.0, model=F.model()), "step"),
        ("step_str", lambda: sv(F.path("s1"), "1", model=F.model()), "step"),
        ("step_none", lambda: sv(F.path("s1"), None, model=F.model()), "step"),
        ("model_int", lambda: sv(F.path("s1"), 1, model=5), "model"),
        ("model_none", lambda: sv(F.path("s1"), 1, model=None), "model"),
        ("optimizer_int", lambda: sv(F.path("s1"), 1, model=F.model(), optimizer=5),
         "optimizer"),
        ("extra_int", lambda: sv(F.path("s1"), 1, model=F.model(), extra=5), "extra"),
        ("extra_object", lambda: sv(F.path("s1"), 1, model=F.model(), extra={"x": object()}),
         "extra"),
        ("extra_nan", lambda: sv(F.path("s1"), 1, model=F.model(), extra={"x": NAN}), "extra"),
        ("extra_int_key", lambda: sv(F.path("s1"), 1, model=F.model(), extra={1: 2}), "extra"),
        ("exists", lambda: (F.saved(), sv(F.saved(), 1, model=F.model()))[1], ("step", "1")),
    ]:
        api(f"save/{label}", arg, fn)
    rs = lambda d, **k: ns().restore(d, **k)  # noqa: E731
    for label, fn, arg in [
        ("dir_none", lambda: rs(None, model=F.model()), "directory"),
        ("dir_missing", lambda: rs(F.path("nowhere"), model=F.model()), "directory"),
        ("dir_empty_folder", lambda: rs(F.dir("empty_ckpt"), model=F.model()),
         ("checkpoint", "directory")),
        ("step_true", lambda: rs(F.saved(), model=F.model(), step=True), "step"),
        ("step_neg", lambda: rs(F.saved(), model=F.model(), step=-1), "step"),
        ("step_float", lambda: rs(F.saved(), model=F.model(), step=1.0), "step"),
        ("step_str", lambda: rs(F.saved(), model=F.model(), step="1"), "step"),
        ("step_missing", lambda: rs(F.saved(), model=F.model(), step=99), "step"),
        ("model_int", lambda: rs(F.saved(), model=5), "model"),
        ("optimizer_int", lambda: rs(F.saved(), model=F.model(), optimizer=5), "optimizer"),
        ("shape_mismatch", lambda: rs(F.saved(), model=__import__("flax").nnx.Linear(
            3, 1, rngs=__import__("flax").nnx.Rngs(0))), ("kernel", "shape")),
        ("checkpointer_step_true", lambda: ck(F.saved()).restore(model=F.model(), step=True),
         "step"),
    ]:
        api(f"restore/{label}", arg, fn)

    # Batches, MetricsWriter -------------------------------------------------------------------------
    x8 = lambda: np.ones((8, 2), np.float32)  # noqa: E731
    for label, fn, arg in [
        ("arrays_int", lambda: ns().Batches(5, 2), "arrays"),
        ("arrays_none", lambda: ns().Batches(None, 2), "arrays"),
        ("arrays_str", lambda: ns().Batches("abc", 2), "arrays"),
        ("arrays_empty_dict", lambda: ns().Batches({}, 2), "arrays"),
        ("arrays_scalar", lambda: ns().Batches(np.float32(1), 2), "arrays"),
        ("arrays_lengths_differ", lambda: ns().Batches({"a": x8(), "b": np.ones(7)}, 2),
         "arrays"),
        ("batch_size_zero", lambda: ns().Batches(x8(), 0), "batch_size"),
        ("batch_size_true", lambda: ns().Batches(x8(), True), "batch_size"),
        ("batch_size_float", lambda: ns().Batches(x8(), 2.0), "batch_size"),
        ("batch_size_none", lambda: ns().Batches(x8(), None), "batch_size"),
        ("batch_size_huge", lambda: ns().Batches(x8(), 10**12), "batch_size"),
        ("epochs_zero", lambda: ns().Batches(x8(), 2, epochs=0), "epochs"),
        ("epochs_true", lambda: ns().Batches(x8(), 2, epochs=True), "epochs"),
        ("epochs_float", lambda: ns().Batches(x8(), 2, epochs=1.5), "epochs"),
        ("window_start_neg", lambda: ns().Batches(x8(), 2).window(-1, 2), "start"),
        ("window_k_zero", lambda: ns().Batches(x8(), 2).window(0, 0), "k"),
        ("window_k_true", lambda: ns().Batches(x8(), 2).window(0, True), "k"),
    ]:
        api(f"Batches/{label}", arg, fn)
    for label, fn, arg in [
        ("dir_none", lambda: ns().MetricsWriter(None, tensorboard=False), "directory"),
        ("dir_int", lambda: ns().MetricsWriter(5, tensorboard=False), "directory"),
        ("dir_empty", lambda: ns().MetricsWriter("", tensorboard=False), "directory"),
        ("dir_is_file", lambda: ns().MetricsWriter(F.file("mw_file", "x"), tensorboard=False),
         "directory"),
        ("tensorboard_str", lambda: ns().MetricsWriter(F.path("mw"), tensorboard="yes"),
         "tensorboard"),
        ("vector_metric", lambda: _vector_metric(), ("metric", "vec")),
    ]:
        api(f"MetricsWriter/{label}", arg, fn)

    # strategies ------------------------------------------------------------------------------------
    st = lambda: ns().strategies  # noqa: E731
    for label, fn, arg in [
        ("get_int", lambda: st().get(5), ("name", "strategy")),
        ("get_empty", lambda: st().get(""), ("name", "strategy")),
        ("get_unknown", lambda: st().get("fsdpp"), "fsdpp"),
        ("get_axis_int", lambda: st().get("dp", data=5), "data"),
        ("get_axis_empty", lambda: st().get("dp", data=""), "data"),
        ("get_axis_unknown", lambda: st().get("dp", bogus="x"), "bogus"),
        ("tp_same_axes", lambda: st().get("tp", data="x", model="x"), ("data", "model")),
        ("pp_repeats_zero", lambda: st().get("pp", repeats=0), "repeats"),
        ("pp_repeats_true", lambda: st().get("pp", repeats=True), "repeats"),
        ("pp_repeats_float", lambda: st().get("pp", repeats=1.5), "repeats"),
        ("pp_repeats_neg", lambda: st().get("pp", repeats=-2), "repeats"),
        ("pp_remat_str", lambda: st().get("pp", remat="yes"), "remat"),
        ("pp_allow_str", lambda: st().get("pp", allow_few_microbatches="no"),
         "allow_few_microbatches"),
        ("mesh_for_zero", lambda: st().get("fsdp_tp").mesh_for(0), "n_devices"),
        ("mesh_for_neg", lambda: st().get("fsdp_tp").mesh_for(-8), "n_devices"),
        ("mesh_for_true", lambda: st().get("fsdp_tp").mesh_for(True), "n_devices"),
        ("mesh_for_float", lambda: st().get("fsdp_tp").mesh_for(8.0), "n_devices"),
        ("make_mesh_zero", lambda: st().get("dp").make_mesh(0), "n_devices"),
        ("check_model_int", lambda: st().get("fsdp").check(5, "data=8"), "model"),
        ("check_mesh_zero", lambda: st().get("fsdp").check(lin(), {"data": 0}), "data"),
        ("suggest_mesh_zero", lambda: st().get("fsdp_tp").suggest_mesh(lin(), 0), "n_devices"),
        ("compiled_collectives_int", lambda: ns().planner.compiled_collectives(5, F.mesh()),
         "hlo_text"),
        ("compiled_collectives_mesh_str", lambda: ns().planner.compiled_collectives("", "data=8"),
         "mesh"),
    ]:
        api(f"strategies/{label}", arg, fn)

    fake = lambda c: {"total": 100, "temp": 1, "flops": 1e9,  # noqa: E731
                      "collective_bytes": 1e6, "collectives": 1}

    def auto(**kw: Any) -> Any:
        base = {"devices": 8, "batch": 8, "seq": 16, "strategies": ["dp"],
                "compile_fn": fake, "progress": False, "device_memory": 1000}
        base.update(kw)
        return ns().planner.auto("tiny", **base)

    for label, kw, arg in [
        ("devices_zero", {"devices": 0}, "devices"),
        ("devices_true", {"devices": True}, "devices"),
        ("devices_float", {"devices": 8.0}, "devices"),
        ("batch_zero", {"batch": 0}, "batch"),
        ("batch_true", {"batch": True}, "batch"),
        ("seq_zero", {"seq": 0}, "seq"),
        ("seq_float", {"seq": 16.0}, "seq"),
        ("device_memory_nan", {"device_memory": NAN}, "device_memory"),
        ("device_memory_inf", {"device_memory": INF}, "device_memory"),
        ("device_memory_zero", {"device_memory": 0}, "device_memory"),
        ("device_memory_neg", {"device_memory": -5}, "device_memory"),
        ("device_memory_true", {"device_memory": True}, "device_memory"),
        ("device_memory_huge", {"device_memory": 1e999}, "device_memory"),
        ("device_memory_text", {"device_memory": "lots"}, "device_memory"),
        ("device_memory_list", {"device_memory": [1]}, "device_memory"),
        ("hardware_unknown", {"hardware": "h100"}, "hardware"),
        ("hardware_int", {"hardware": 5}, "hardware"),
        ("optimizer_unknown", {"optimizer": "adamz"}, "optimizer"),
        ("strategies_empty", {"strategies": []}, "strategies"),
        ("strategies_str", {"strategies": "dp"}, "strategies"),
        ("strategies_unknown", {"strategies": ["nope"]}, "nope"),
        ("strategies_int", {"strategies": 5}, "strategies"),
        ("remat_unknown", {"remat": ["x"]}, "remat"),
        ("remat_str", {"remat": "dots"}, "remat"),
        ("microbatches_zero", {"microbatches": [0]}, "microbatches"),
        ("microbatches_neg", {"microbatches": [-2]}, "microbatches"),
        ("microbatches_true", {"microbatches": [True]}, "microbatches"),
        ("microbatches_float", {"microbatches": [1.5]}, "microbatches"),
        ("microbatches_int", {"microbatches": 4}, "microbatches"),
        ("microbatches_empty", {"microbatches": []}, "microbatches"),
        ("max_compiles_neg", {"max_compiles": -5}, "max_compiles"),
        ("max_compiles_zero", {"max_compiles": 0}, "max_compiles"),
        ("max_compiles_true", {"max_compiles": True}, "max_compiles"),
        ("timeout_zero", {"timeout": 0}, "timeout"),
        ("timeout_nan", {"timeout": NAN}, "timeout"),
        ("cache_int", {"cache": 5}, "cache"),
        ("unknown_knob", {"devicez": 8}, "devicez"),
    ]:
        api(f"auto/{label}", arg, lambda kw=kw: auto(**kw))
    api("auto/model_int", "model", lambda: ns().planner.auto(5, devices=8, batch=8, seq=16))
    api("auto/model_unknown", "model", lambda: ns().planner.auto("hug", devices=8, batch=8, seq=16))
    api("auto/options_int", "options", lambda: ns().planner.auto("tiny", 5))
    hostile_caches = {
        "cache_list": "[1, 2, 3]",
        "cache_entry_int": "ENTRY:5",
        "cache_entry_missing_keys": 'ENTRY:{"temp": 1}',
        "cache_entry_negative_total": ('ENTRY:{"total": -5, "temp": 1, "flops": 1e9, '
                                       '"collective_bytes": 1e6, "collectives": 1}'),
        "cache_entry_nan_total": ('ENTRY:{"total": NaN, "temp": 1, "flops": 1e9, '
                                  '"collective_bytes": 1e6, "collectives": 1}'),
        "cache_entry_str_flops": ('ENTRY:{"total": 5, "temp": 1, "flops": "x", '
                                  '"collective_bytes": 1e6, "collectives": 1}'),
        "cache_not_json": "{{{",
        "cache_binary": b"\xff\xfe\x00",
    }
    for label, content in hostile_caches.items():
        api(f"auto/{label}", "cache", lambda label=label, content=content: _hostile_cache(
            label, content))
    api("auto/cache_unwritable", "cache", lambda: _unwritable_cache())

    # models ------------------------------------------------------------------------------------
    mdl = lambda: ns().models  # noqa: E731
    for label, kw, arg in [
        ("vocab_zero", {"vocab": 0}, "vocab"), ("vocab_true", {"vocab": True}, "vocab"),
        ("vocab_float", {"vocab": 128.5}, "vocab"), ("vocab_none", {"vocab": None}, "vocab"),
        ("vocab_str", {"vocab": "128"}, "vocab"),
        ("embed_neg", {"embed": -1}, "embed"), ("heads_zero", {"heads": 0}, "heads"),
        ("layers_nan", {"layers": NAN}, "layers"), ("mlp_true", {"mlp": True}, "mlp"),
        ("experts_neg", {"experts": -1}, "experts"),
        ("top_k_over", {"experts": 2, "top_k": 3}, "top_k"),
        ("capacity_nan", {"experts": 4, "capacity_factor": NAN}, "capacity_factor"),
        ("capacity_zero", {"experts": 4, "capacity_factor": 0.0}, "capacity_factor"),
        ("aux_weight_nan", {"aux_loss_weight": NAN}, "aux_loss_weight"),
        ("remat_bogus", {"remat": "bogus"}, "remat"),
        ("dtype_bogus", {"dtype": "float99"}, "dtype"),
        ("scan_layers_str", {"scan_layers": "yes"}, "scan_layers"),
    ]:
        api(f"ReferenceConfig/{label}", arg,
            lambda kw=kw: mdl().ReferenceConfig(**kw))
    for label, kw, arg in [
        ("heads_zero", {"heads": 0}, "heads"), ("kv_heads_zero", {"kv_heads": 0}, "kv_heads"),
        ("kv_not_dividing", {"heads": 4, "kv_heads": 3}, "kv_heads"),
        ("vocab_true", {"vocab": True}, "vocab"), ("layers_neg", {"layers": -1}, "layers"),
        ("rope_theta_nan", {"rope_theta": NAN}, "rope_theta"),
        ("rope_theta_zero", {"rope_theta": 0.0}, "rope_theta"),
        ("norm_eps_neg", {"norm_eps": -1.0}, "norm_eps"),
        ("head_dim_float", {"head_dim": 8.5}, "head_dim"),
    ]:
        api(f"DecoderConfig/{label}", arg, lambda kw=kw: mdl().DecoderConfig(**kw))
    for label, fn, arg in [
        ("get_config_unknown", lambda: mdl().get_config("huge"), "huge"),
        ("get_config_int", lambda: mdl().get_config(5), ("name", "config")),
        ("get_llama_config_unknown", lambda: mdl().get_config("huge"), "huge"),
        ("remat_policy_unknown", lambda: mdl().remat_policy("bogus"), "bogus"),
        ("transformer_cfg_int", lambda: mdl().Decoder(5, rngs=_rngs()), ("cfg", "config")),
        ("llama_cfg_str", lambda: mdl().Decoder("tiny", rngs=_rngs()), ("cfg", "config")),
        ("lm_loss_batch_int", lambda: mdl().lm_loss(_tiny_lm(), 5), "batch"),
        ("lm_loss_batch_missing_key", lambda: mdl().lm_loss(_tiny_lm(), {"x": 1}), "batch"),
        ("attention_rank", lambda: mdl().attention(jnp().ones((2, 4)), jnp().ones((2, 4)),
                                                   jnp().ones((2, 4))), ("q", "shape")),
        ("attention_shapes_differ", lambda: mdl().attention(
            jnp().ones((1, 4, 2, 8)), jnp().ones((1, 5, 2, 8)), jnp().ones((1, 4, 2, 8))),
         ("k", "shape")),
        ("attention_mode_typo", lambda: _attention_mode("rnig"), "rnig"),
    ]:
        api(f"models/{label}", arg, fn)

    # pipeline ------------------------------------------------------------------------------------
    pl = lambda: ns().pipeline  # noqa: E731
    for fname in ("bubble", "idle_fraction", "schedule_table"):
        for label, a, arg in [
            ("zero_zero", (0, 0), "stages"), ("stages_neg", (-1, 4), "stages"),
            ("microbatches_zero", (4, 0), "microbatches"),
            ("microbatches_neg", (4, -8), "microbatches"),
            ("stages_true", (True, 4), "stages"), ("microbatches_float", (4, 1.5),
                                                    "microbatches"),
            ("repeats_zero", (4, 4, 0), "repeats"), ("microbatches_nan", (4, NAN),
                                                      "microbatches"),
            ("stages_none", (None, 4), "stages"),
        ]:
            api(f"pipeline.{fname}/{label}", arg,
                lambda fname=fname, a=a: getattr(pl(), fname)(*a))
    api("pipeline.schedule_table/huge", ("stages", "microbatches"),
        lambda: pl().schedule_table(10**6, 10**6))
    for label, kw, arg in [
        ("repeats_zero", {"repeats": 0}, "repeats"), ("repeats_true", {"repeats": True},
                                                      "repeats"),
        ("axis_int", {"axis": 5}, "axis"), ("axis_empty", {"axis": ""}, "axis"),
        ("remat_str", {"remat": "no"}, "remat"),
    ]:
        api(f"pipeline.Schedule/{label}", arg, lambda kw=kw: pl().Schedule(**kw))
    for label, m, arg in [("microbatches_neg", -4, "microbatches"),
                          ("microbatches_zero", 0, "microbatches"),
                          ("microbatches_true", True, "microbatches"),
                          ("microbatches_float", 4.0, "microbatches"),
                          ("microbatches_not_dividing", 3, "microbatches")]:
        api(f"pipeline.stage_report/{label}", arg, lambda m=m: _stage_report(m))
    api("pipeline.stage_report/carry_int", "carry", lambda: _stage_report(4, carry=5))
    api("pipeline.stage_report/strategy_str_unknown", "strategy",
        lambda: _stage_report(4, strategy="nope"))
    api("pipeline.scan/body_int", "body", lambda: _under(
        lambda: pl().scan(5, jnp().ones((4,)), F.model())))
    api("pipeline.scan/microbatches_zero", "microbatches", lambda: _under(
        lambda: pl().scan(lambda c, layer: (c, None), jnp().ones((4,)), F.model(),
                          microbatches=0)))

    # collective_matmul -----------------------------------------------------------------------------
    cm = lambda: ns().collective_matmul  # noqa: E731
    cm_impl = lambda: __import__("nnx_shard._parallel.collective_matmul", fromlist=["x"])  # noqa: E731
    for label, fn, arg in [
        ("ag_eq_bad", lambda: cm().all_gather_matmul("bogus", jnp().ones((8, 4)),
                                                     jnp().ones((4, 8)), gather="b",
                                                     shard="f", mesh=F.mesh("model=8")), "eq"),
        ("ag_gather_not_in_eq", lambda: cm().all_gather_matmul(
            "bd,df->bf", jnp().ones((8, 4)), jnp().ones((4, 8)), gather="z", shard="f",
            mesh=F.mesh("model=8")), "gather"),
        ("ag_axis_missing", lambda: cm().all_gather_matmul(
            "bd,df->bf", jnp().ones((8, 4)), jnp().ones((4, 8)), gather="b", shard="f",
            axis="nope", mesh=F.mesh("model=8")), "nope"),
        ("ag_x_str", lambda: cm().all_gather_matmul(
            "bd,df->bf", "x", jnp().ones((4, 8)), gather="b", shard="f",
            mesh=F.mesh("model=8")), "x"),
        ("rs_contract_not_in_eq", lambda: cm().matmul_reduce_scatter(
            "bd,df->bf", jnp().ones((8, 8)), jnp().ones((8, 8)), scatter="b", contract="z",
            mesh=F.mesh("model=8")), "contract"),
        ("rs_not_dividing", lambda: cm().matmul_reduce_scatter(
            "bd,df->bf", jnp().ones((6, 8)), jnp().ones((8, 8)), scatter="b", contract="d",
            mesh=F.mesh("model=8")), ("scatter", "divid", "6")),
        ("check_tokens_neg", lambda: cm_impl().check_tokens((-1, 4)), ("shape", "tokens")),
        ("check_tokens_str", lambda: cm_impl().check_tokens("ab"), ("shape", "tokens")),
        ("check_tokens_names_mismatch", lambda: cm_impl().check_tokens((8, 4), ("batch",)),
         ("names", "shape")),
    ]:
        api(f"collective_matmul/{label}", arg, fn)

    # tp_layers --------------------------------------------------------------------------------------
    tl = lambda: ns().tp_layers  # noqa: E731
    api("tp_layers.intercept/str", "model", lambda: tl().intercept("model"))
    api("tp_layers.intercept/int", "model", lambda: tl().intercept(5))
    api("tp_layers.ProjectionOp/kind_unknown", "kind",
        lambda: tl().ProjectionOp(("embed",), "matmul"))
    api("tp_layers.ProjectionOp/names_list", "names",
        lambda: tl().ProjectionOp(["embed"], "einsum"))

    # distributed ------------------------------------------------------------------------------------
    ds = lambda: ns().distributed  # noqa: E731
    for label, kw, arg in [
        ("num_processes_zero", {"num_processes": 0, "process_id": 0,
                                "coordinator_address": "127.0.0.1:1"}, "num_processes"),
        ("num_processes_true", {"num_processes": True, "process_id": 0,
                                "coordinator_address": "127.0.0.1:1"}, "num_processes"),
        ("num_processes_float", {"num_processes": 2.0, "process_id": 0,
                                 "coordinator_address": "127.0.0.1:1"}, "num_processes"),
        ("process_id_neg", {"num_processes": 2, "process_id": -1,
                            "coordinator_address": "127.0.0.1:1"}, "process_id"),
        ("process_id_too_big", {"num_processes": 2, "process_id": 2,
                                "coordinator_address": "127.0.0.1:1"}, "process_id"),
        ("process_id_true", {"num_processes": 2, "process_id": True,
                             "coordinator_address": "127.0.0.1:1"}, "process_id"),
        ("address_no_port", {"num_processes": 2, "process_id": 0,
                             "coordinator_address": "localhost"}, ("coordinator", "port")),
        ("address_bad_port", {"num_processes": 2, "process_id": 0,
                              "coordinator_address": "localhost:99999"},
         ("coordinator", "port")),
        ("address_int", {"num_processes": 2, "process_id": 0, "coordinator_address": 5},
         "coordinator"),
        ("timeout_nan", {"num_processes": 2, "process_id": 0,
                         "coordinator_address": "127.0.0.1:1",
                         "initialization_timeout": NAN}, "initialization_timeout"),
        ("timeout_neg", {"num_processes": 2, "process_id": 0,
                         "coordinator_address": "127.0.0.1:1",
                         "initialization_timeout": -1}, "initialization_timeout"),
        ("heartbeat_zero", {"num_processes": 2, "process_id": 0,
                            "coordinator_address": "127.0.0.1:1", "heartbeat_timeout": 0},
         "heartbeat_timeout"),
        ("local_device_ids_str", {"num_processes": 2, "process_id": 0,
                                  "coordinator_address": "127.0.0.1:1",
                                  "local_device_ids": "0"}, "local_device_ids"),
    ]:
        api(f"distributed.initialize/{label}", arg, lambda kw=kw: ds().initialize(**kw))
    for label, fn, arg in [
        ("batch_size_zero", lambda: ds().process_slice(0, "data=8", {"batch": "data"}),
         "batch_size"),
        ("batch_size_neg", lambda: ds().process_slice(-8, "data=8", {"batch": "data"}),
         "batch_size"),
        ("batch_size_true", lambda: ds().process_slice(True, "data=8", {"batch": "data"}),
         "batch_size"),
        ("batch_size_float", lambda: ds().process_slice(8.0, "data=8", {"batch": "data"}),
         "batch_size"),
        ("batch_size_not_dividing", lambda: ds().process_slice(7, "data=8",
                                                               {"batch": "data"}),
         ("batch", "7")),
        ("name_int", lambda: ds().process_slice(8, "data=8", {"batch": "data"}, name=5),
         "name"),
        ("name_unknown", lambda: ds().process_slice(8, "data=8", {"batch": "data"},
                                                    name="batchh"), "batchh"),
        ("local_part_int", lambda: ds().local_part(5, "data=8", {"batch": "data"}), "batch"),
        ("local_part_rows", lambda: ds().local_part(np.ones((7, 2)), "data=8",
                                                    {"batch": "data"}), ("batch", "7")),
        ("gather_str", lambda: ds().gather("abc"), "tree"),
        ("gather_object", lambda: ds().gather({"a": object()}), "tree"),
    ]:
        api(f"distributed/{label}", arg, fn)

    # hf ---------------------------------------------------------------------------------------------
    hf = lambda: ns().hf  # noqa: E731
    for label, fn, arg in [
        ("load_path_none", lambda: hf().load_safetensors(None, _tiny_llama()), "path"),
        ("load_path_int", lambda: hf().load_safetensors(5, _tiny_llama()), "path"),
        ("load_missing", lambda: hf().load_safetensors(F.path("none.safetensors"),
                                                       _tiny_llama()), "path"),
        ("load_empty_dir", lambda: hf().load_safetensors(F.dir("empty_hf"), _tiny_llama()),
         ("path", "safetensors")),
        ("load_not_safetensors", lambda: hf().load_safetensors(
            F.file("x.safetensors", b"\x00" * 16), _tiny_llama()), ("safetensors", "header")),
        ("load_huge_header", lambda: hf().load_safetensors(
            F.file("h.safetensors", (2**62).to_bytes(8, "little") + b"{}"), _tiny_llama()),
         ("safetensors", "header")),
        ("load_header_bad_json", lambda: hf().load_safetensors(
            F.file("j.safetensors", (4).to_bytes(8, "little") + b"{{{{"), _tiny_llama()),
         ("safetensors", "header")),
        ("load_fifo", lambda: hf().load_safetensors(F.fifo("f.safetensors"), _tiny_llama()),
         ("path", "safetensors")),
        ("load_target_int", lambda: hf().load_safetensors(F.path("none.safetensors"), 5),
         ("target", "path")),
        ("load_mapping_int", lambda: hf().load_safetensors(_hf_file(), _tiny_llama(),
                                                            mapping=5), "mapping"),
        ("save_path_none", lambda: hf().save_safetensors(None, _tiny_llama()), "path"),
        ("save_model_int", lambda: hf().save_safetensors(F.path("o1"), 5), "model"),
        ("save_max_shard_zero", lambda: hf().save_safetensors(F.path("o2"), _tiny_llama(),
                                                              max_shard_bytes=0),
         "max_shard_bytes"),
        ("save_max_shard_true", lambda: hf().save_safetensors(F.path("o3"), _tiny_llama(),
                                                              max_shard_bytes=True),
         "max_shard_bytes"),
        ("save_max_shard_nan", lambda: hf().save_safetensors(F.path("o4"), _tiny_llama(),
                                                             max_shard_bytes=NAN),
         "max_shard_bytes"),
        ("save_dtype_bogus", lambda: hf().save_safetensors(F.path("o5"), _tiny_llama(),
                                                           dtype="float99"), "dtype"),
        ("save_path_is_file", lambda: hf().save_safetensors(F.file("o6", "x"), _tiny_llama()),
         "path"),
        ("mapping_for_int", lambda: hf().mapping_for(5), "model"),
    ]:
        api(f"hf/{label}", arg, fn)

    # the command ------------------------------------------------------------------------------------
    plan = ("plan", "--model", "tiny", "--batch", "8", "--seq", "16", "--no-compile")
    for label, extra, arg in [
        ("model_unknown", ("--model", "huge"), "huge"),
        ("mesh_empty", ("--mesh", ""), "--mesh"),
        ("mesh_zero", ("--mesh", "data=0"), ("--mesh", "data")),
        ("mesh_nan", ("--mesh", "data=nan"), ("--mesh", "data")),
        ("mesh_neg", ("--mesh", "data=-3"), ("--mesh", "data")),
        ("mesh_huge", ("--mesh", "data=" + "9" * 40), ("--mesh", "data")),
        ("batch_zero", ("--mesh", "data=8", "--batch", "0"), "--batch"),
        ("batch_neg", ("--mesh", "data=8", "--batch", "-8"), "--batch"),
        ("batch_text", ("--mesh", "data=8", "--batch", "x"), "--batch"),
        ("seq_zero", ("--mesh", "data=8", "--seq", "0"), "--seq"),
        ("seq_too_long", ("--mesh", "data=8", "--seq", "100000"), "--seq"),
        ("device_memory_zero", ("--mesh", "data=8", "--device-memory", "0"), "--device-memory"),
        ("device_memory_nan", ("--mesh", "data=8", "--device-memory", "nan"),
         "--device-memory"),
        ("device_memory_inf", ("--mesh", "data=8", "--device-memory", "inf"),
         "--device-memory"),
        ("device_memory_huge", ("--mesh", "data=8", "--device-memory", "1e999"),
         "--device-memory"),
        ("device_memory_neg", ("--mesh", "data=8", "--device-memory", "-5GB"),
         "--device-memory"),
        ("device_memory_empty", ("--mesh", "data=8", "--device-memory", ""), "--device-memory"),
        ("top_neg", ("--mesh", "data=8", "--top", "-1"), "--top"),
        ("compile_timeout_zero", ("--mesh", "data=8", "--compile-timeout", "0"),
         "--compile-timeout"),
        ("compile_timeout_nan", ("--mesh", "data=8", "--compile-timeout", "nan"),
         "--compile-timeout"),
        ("optimizer_unknown", ("--mesh", "data=8", "--optimizer", "adamz"), "adamz"),
        ("strategy_unknown", ("--mesh", "data=8", "--strategy", "fsdpp"), "fsdpp"),
        ("remat_unknown", ("--mesh", "data=8", "--remat", "bogus"), "--remat"),
        ("mesh_not_dividing_batch", ("--mesh", "data=3", "--strategy", "dp"), ("batch", "3")),
        ("no_mesh", (), "--mesh"),
        ("unknown_flag", ("--mesh", "data=8", "--bogus"), "--bogus"),
    ]:
        cli(f"cli plan/{label}", arg, *plan, *extra)
    auto_argv = ("plan", "--auto", "--model", "tiny", "--batch", "8", "--seq", "16", "--devices",
            "8", "--strategies", "dp", "--max-compiles", "1")
    for label, extra, arg in [
        ("link_latency_nan", ("--link-latency", "nan"), "--link-latency"),
        ("link_latency_inf", ("--link-latency", "inf"), "--link-latency"),
        ("link_latency_neg", ("--link-latency", "-1"), "--link-latency"),
        ("link_latency_huge", ("--link-latency", "1e999"), "--link-latency"),
        ("link_latency_text", ("--link-latency", "x"), "--link-latency"),
        ("peak_flops_zero", ("--peak-flops", "0"), "--peak-flops"),
        ("peak_flops_nan", ("--peak-flops", "nan"), "--peak-flops"),
        ("link_bandwidth_inf", ("--link-bandwidth", "inf"), "--link-bandwidth"),
        ("device_memory_zero", ("--device-memory", "0"), "--device-memory"),
        ("device_memory_nan", ("--device-memory", "nan"), "--device-memory"),
        ("device_memory_huge", ("--device-memory", "1e999"), "--device-memory"),
        ("devices_zero", ("--devices", "0"), "--devices"),
        ("devices_neg", ("--devices", "-8"), "--devices"),
        ("strategies_empty", ("--strategies", ""), "--strategies"),
        ("strategies_commas", ("--strategies", ",,"), "--strategies"),
        ("strategies_unknown", ("--strategies", "nope"), "nope"),
        ("max_compiles_neg", ("--max-compiles", "-5"), "--max-compiles"),
        ("max_compiles_zero", ("--max-compiles", "0"), "--max-compiles"),
        ("top_neg", ("--top", "-1"), "--top"),
        ("hardware_unknown", ("--hardware", "h100"), "h100"),
        ("with_mesh", ("--mesh", "data=8"), "--mesh"),
        ("compile_timeout_neg", ("--compile-timeout", "-1"), "--compile-timeout"),
    ]:
        cli(f"cli plan --auto/{label}", arg, *auto_argv, *extra, "--no-cache")
    for label, content in hostile_caches.items():
        CASES.append(Case(f"cli plan --auto/{label}", ("cache",), fn=lambda label=label,
                          content=content: _cli_with_cache(label, content, auto_argv), kind="api"))
    CASES.append(Case("cli plan --auto/cache_unwritable", ("cache",),
                      fn=lambda: _cli_unwritable_cache(auto_argv), kind="api", slow=True))
    for label, argv, arg in [
        ("factory_no_colon", ("explain", "nocolon", "--mesh", "data=8", "--strategy", "dp"),
         "nocolon"),
        ("factory_missing_module", ("explain", "no_such_mod_xyz:make", "--mesh", "data=8",
                                    "--strategy", "dp"), "no_such_mod_xyz"),
        ("factory_missing_attr", ("explain", "os:no_such_fn", "--mesh", "data=8",
                                  "--strategy", "dp"), "no_such_fn"),
        ("factory_returns_str", ("explain", "os:getcwd", "--mesh", "data=8", "--strategy",
                                 "dp"), "os:getcwd"),
        ("factory_needs_args", ("explain", "os:listdir", "--mesh", "data=8", "--strategy",
                                "dp"), ("os:listdir", "FACTORY")),
        ("factory_sys_exit", ("explain", "FILE:exit_factory.py:make", "--mesh", "data=8",
                              "--strategy", "dp"), ("FACTORY", "exit")),
        ("factory_raises", ("explain", "FILE:raise_factory.py:make", "--mesh", "data=8",
                            "--strategy", "dp"), "FACTORY"),
        ("factory_file_missing", ("explain", "/no/such/file.py:make", "--mesh", "data=8",
                                  "--strategy", "dp"), "file"),
        ("mesh_zero", ("explain", "FILE:good_factory.py:make", "--mesh", "data=0",
                       "--strategy", "dp"), ("--mesh", "data")),
        ("mesh_minus_one", ("explain", "FILE:good_factory.py:make", "--mesh", "data=-1",
                            "--strategy", "dp"), "--mesh"),
        ("no_rules", ("explain", "FILE:good_factory.py:make", "--mesh", "data=8"),
         ("--rules", "--strategy")),
        ("rules_missing", ("explain", "FILE:good_factory.py:make", "--mesh", "data=8",
                           "--rules", "/no/such/rules.toml"), "--rules"),
        ("rules_dir", ("explain", "FILE:good_factory.py:make", "--mesh", "data=8", "--rules",
                       "DIR"), "--rules"),
        ("rules_fifo", ("explain", "FILE:good_factory.py:make", "--mesh", "data=8",
                        "--rules", "FIFO"), "--rules"),
        ("rules_bomb", ("explain", "FILE:good_factory.py:make", "--mesh", "data=8",
                        "--rules", "BOMB"), "--rules"),
        ("rules_deep", ("explain", "FILE:good_factory.py:make", "--mesh", "data=8",
                        "--rules", "DEEP"), "--rules"),
        ("rules_binary", ("explain", "FILE:good_factory.py:make", "--mesh", "data=8",
                          "--rules", "BINARY"), "--rules"),
        ("optimizer_unknown", ("explain", "FILE:good_factory.py:make", "--mesh", "data=8",
                               "--strategy", "dp", "--optimizer", "adamz"), "adamz"),
        ("strategy_unknown", ("explain", "FILE:good_factory.py:make", "--mesh", "data=8",
                              "--strategy", "fsdpp"), "fsdpp"),
    ]:
        CASES.append(Case(f"cli explain/{label}", _names(arg),
                          fn=lambda argv=argv, bomb=bomb, deep=deep: _explain(argv, bomb, deep),
                          kind="api"))
    demo = ("demo", "--out", "OUT", "--no-progress")
    for label, extra, arg in [
        ("steps_zero", ("--steps", "0"), "--steps"), ("steps_neg", ("--steps", "-1"), "--steps"),
        ("steps_huge", ("--steps", "10000000000"), "--steps"),
        ("steps_text", ("--steps", "1e3"), "--steps"),
        ("steps_per_call_zero", ("--steps-per-call", "0"), "--steps-per-call"),
        ("batch_zero", ("--batch", "0"), "--batch"), ("seq_zero", ("--seq", "0"), "--seq"),
        ("embed_zero", ("--embed", "0"), "--embed"), ("heads_zero", ("--heads", "0"), "--heads"),
        ("heads_not_dividing", ("--heads", "3"), "--heads"),
        ("mlp_neg", ("--mlp", "-4"), "--mlp"), ("layers_zero", ("--layers", "0"), "--layers"),
        ("experts_neg", ("--experts", "-1"), "--experts"),
        ("lr_nan", ("--lr", "nan"), "--lr"), ("lr_zero", ("--lr", "0"), "--lr"),
        ("lr_inf", ("--lr", "inf"), "--lr"),
        ("temperature_neg", ("--temperature", "-1"), "--temperature"),
        ("temperature_nan", ("--temperature", "nan"), "--temperature"),
        ("evals_neg", ("--evals", "-1"), "--evals"),
        ("sample_chars_neg", ("--sample-chars", "-5"), "--sample-chars"),
        ("strategy_unknown", ("--strategy", "fsdpp"), "fsdpp"),
        ("mesh_not_devices", ("--mesh", "data=3"), ("--mesh", "mesh data=3")),
        ("restore_strategy_unknown", ("--restore-strategy", "nope"), "nope"),
        ("axis_types_bogus", ("--axis-types", "bogus"), "--axis-types"),
        ("seed_text", ("--seed", "x"), "--seed"),
    ]:
        CASES.append(Case(f"cli demo/{label}", _names(arg), fn=lambda extra=extra: _demo(
            demo, extra), kind="api"))
    CASES.append(Case("cli demo/out_is_file", ("--out",), fn=lambda: _demo(
        ("demo", "--out", F.file("demo_out_file", "x"), "--no-progress"), ()), kind="api"))
    launch = ("launch",)
    for label, extra, arg in [
        ("n_zero", ("-n", "0"), ("-n", "num-processes", "processes")),
        ("n_neg", ("-n", "-1"), ("-n", "num-processes", "processes")),
        ("n_huge", ("-n", "100000"), ("-n", "num-processes", "processes")),
        ("n_text", ("-n", "x"), ("-n", "num-processes")),
        ("no_command", ("-n", "2"), "command"),
        ("timeout_nan", ("-n", "2", "--timeout", "nan"), "--timeout"),
        ("timeout_neg", ("-n", "2", "--timeout", "-1"), "--timeout"),
        ("grace_nan", ("-n", "2", "--grace", "nan"), "--grace"),
        ("grace_neg", ("-n", "2", "--grace", "-3"), "--grace"),
        ("port_huge", ("-n", "2", "--port", "70000"), "--port"),
        ("port_neg", ("-n", "2", "--port", "-1"), "--port"),
        ("devices_per_process_zero", ("-n", "2", "--devices-per-process", "0"),
         "--devices-per-process"),
        ("init_timeout_zero", ("-n", "2", "--init-timeout", "0"), "--init-timeout"),
        ("heartbeat_timeout_neg", ("-n", "2", "--heartbeat-timeout", "-1"),
         "--heartbeat-timeout"),
    ]:
        cmd = () if label == "no_command" else ("--", sys.executable, "-c", "pass")
        cli(f"cli launch/{label}", arg, *launch, *extra, *cmd)
    cli("cli/unknown_command", "COMMAND", "bogus-command")
    # The console script itself, in a real subprocess (slow: one Python start each).
    for label, argv, arg in [
        ("plan_device_memory_nan", (*plan, "--mesh", "data=8", "--device-memory", "nan"),
         "--device-memory"),
        ("plan_top_neg", (*plan, "--mesh", "data=8", "--top", "-1"), "--top"),
        ("auto_link_latency_nan", (*auto_argv, "--link-latency", "nan", "--no-cache"),
         "--link-latency"),
        ("auto_strategies_empty", (*auto_argv, "--strategies", "", "--no-cache"), "--strategies"),
        ("explain_missing_module", ("explain", "no_such_mod_xyz:make", "--mesh", "data=8",
                                    "--strategy", "dp"), "no_such_mod_xyz"),
        ("demo_steps_zero", ("demo", "--steps", "0", "--out", "OUT"), "--steps"),
        ("launch_n_zero", ("launch", "-n", "0", "--", "true"), ("-n", "processes")),
    ]:
        proc(f"process/{label}", arg, *argv)
    _build_case_files()


def _build_case_files() -> None:
    """Cases kept in files of their own, one per surface: ``tests/hostile_cases/*.py``,
    each with ``build(hs)`` that registers its cases through this module (passed in, since
    it runs both as ``tests.hostile_sweep`` and as a script)."""
    import importlib.util

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostile_cases")
    for name in sorted(os.listdir(here)) if os.path.isdir(here) else []:
        if not name.endswith(".py") or name.startswith("_"):
            continue
        spec = importlib.util.spec_from_file_location(f"_hostile_cases_{name[:-3]}",
                                                      os.path.join(here, name))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.build(sys.modules[__name__])


# -- helpers the cases call ---------------------------------------------------------------------


def zero_filled(abstract: Any) -> Any:
    """``abstract`` (an ``nnx.eval_shape`` or ``abstract_init`` model) made concrete with zero
    tables, each in its sharding (the default placement where it has none), for cases whose
    refusal reads shapes, shardings and the config, never a value: a random init compiles one
    program per shape eagerly (seconds), a sharded one a program of its own."""
    import jax
    import numpy as np
    from flax import nnx

    graph, state = nnx.split(abstract)
    return nnx.merge(graph, jax.tree.map(lambda s: jax.device_put(
        np.zeros(s.shape, s.dtype), getattr(s, "sharding", None)), state))


def generation_config(new: Any, kw: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The ``GenerationConfig`` of ``kw``'s settings (``new`` new tokens; a temperature
    given samples), built in the case so its errors count, and the call's other keywords."""
    import dataclasses

    from nnx_shard.inference import GenerationConfig

    fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    settings = {k: v for k, v in kw.items() if k in fields}
    if settings.get("temperature", 0) != 0 and "do_sample" not in settings:
        settings["do_sample"] = True
    return (GenerationConfig(max_new_tokens=new, **settings),
            {k: v for k, v in kw.items() if k not in fields})


def _link(name: str, target: str) -> str:
    p = F.path(name)
    if not os.path.lexists(p):
        os.symlink(target, p)
    return p


def _aux_loss(aux: dict[str, Any]) -> Callable[..., Any]:
    def loss(m: Any, b: Any) -> Any:
        return F.mse(m, b), dict(aux)

    return loss


def _vector_metric() -> Any:
    """A trainer whose aux metric is a vector, with a MetricsWriter: must write or refuse."""
    import jax.numpy as jnp

    import nnx_shard as ns

    def loss(m: Any, b: Any) -> Any:
        return F.mse(m, b), {"vec": jnp.arange(3.0)}

    d = F.path("mw_vec")
    with ns.MetricsWriter(d, tensorboard=False) as w:
        F.fit(F.trainer(loss, has_aux=True), callbacks=[w])
    rows = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
    if rows and rows[-1].get("vec") == [0.0, 1.0, 2.0]:
        raise _Documented("metric 'vec' written as a list (the documented behaviour)")
    return rows


def _swap(fn: Callable[[], Any], old: str, new: str) -> Any:
    import nnx_shard as ns

    saved = getattr(ns, old)
    setattr(ns, old, getattr(ns, new))
    try:
        return fn()
    finally:
        setattr(ns, old, saved)


def _under(fn: Callable[[], Any]) -> Any:
    import nnx_shard as ns

    with ns.use("data=8", {"batch": "data", "embed": None}):
        return fn()


def _enter(cm: Any) -> Any:
    with cm:
        return None


def _rngs() -> Any:
    from flax import nnx

    return nnx.Rngs(0)


def _tiny_lm() -> Any:
    import nnx_shard as ns

    return ns.models.Decoder(ns.models.ReferenceConfig(), rngs=_rngs())


def _tiny_llama() -> Any:
    import nnx_shard as ns

    return ns.models.Decoder(ns.models.DecoderConfig(), rngs=_rngs())


def _hf_file() -> str:
    p = F.path("good_hf")
    if not os.path.isdir(p):
        import nnx_shard as ns

        ns.hf.save_safetensors(p, _tiny_llama())
    return p


# Fixture folders the case files (tests/hostile_cases/) build their hostile copies from.
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
TEXT_FIXTURE = os.path.join(FIXTURES, "hf_llama_text")  # a tokenizer folder
MODEL_FIXTURE = os.path.join(FIXTURES, "hf_llama")  # a checkpoint with no tokenizer


def load_dp(folder: Any) -> Any:
    """``load_pretrained`` of the checkpoint ``folder`` on ``data=8`` with ``dp``'s rules."""
    import nnx_shard as ns

    return ns.hf.load_pretrained(folder, mesh="data=8", rules=ns.strategies.get("dp").rules)


def hf_text(fn: str, new: Any, kw: dict[str, Any]) -> Any:
    """``generate_text`` of ``["Hello"]`` (or ``stream_text`` of ``"Hello"``, all its
    pieces) by the hf_llama fixture with the tokenizer fixture, ``new`` new tokens and the
    settings of ``kw`` (see :func:`generation_config`)."""
    from nnx_shard.inference import Tokenizer
    from nnx_shard.inference import _text as t

    model = load_dp(MODEL_FIXTURE)
    config, rest = generation_config(new, kw)
    tok = Tokenizer.from_pretrained(TEXT_FIXTURE)
    if fn == "stream_text":
        return list(t.stream_text(model, tok, "Hello", config, **rest))
    return t.generate_text(model, tok, ["Hello"], config, **rest)


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def hf_publish_copy(folder: str | os.PathLike[str]) -> Path:
    """A fresh copy of the hf_publish checkpoint (a tokenizer of 128 ids) at ``folder``."""
    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for p in (Path(FIXTURES) / "hf_publish").iterdir():
        shutil.copy(p, folder / p.name)
    return folder


def save_nothing(parent: str | os.PathLike[str], model: Any, **kw: Any) -> Any:
    """``save_safetensors`` of ``model`` to ``parent/out``, which must stay absent, with
    nothing new beside it (else an AssertionError: the case is ``raw``)."""
    import nnx_shard as ns

    parent = Path(parent)
    out = parent / "out"
    before = listing(parent)
    try:
        return ns.hf.save_safetensors(out, model, **kw)
    finally:
        if out.exists() or listing(parent) != before:
            raise AssertionError(f"{parent}: an export or a staging folder was left")


def one_shard(folder: Path) -> Path:
    """``folder`` with its weights as the one shard its index lists (the index is read)."""
    from nnx_shard import _safetensors_io as st

    keys = list(st.read_header(str(folder / "model.safetensors")).tensors)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001-of-00001.safetensors" for k in keys}}))
    return folder


def norm_on_layer0(path: str | os.PathLike[str]) -> None:
    """Points the safetensors file ``path``'s ``model.norm.weight`` at the bytes of layer 0's
    input norm (both [32] F32 in the hf_llama fixture): its header then overlaps two tensors."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["model.norm.weight"]["data_offsets"] = header[
        "model.layers.0.input_layernorm.weight"]["data_offsets"]
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + data[8 + n:])


# What a swapped-in link leads to: a private key, that no error or result may show.
SECRET = '{"secret": "-----BEGIN PRIVATE KEY----- not to be published"}'
TOKENIZER_FILES = ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json")


def private_swap(folder: Path, name: str, how: str) -> Callable[[], None]:
    """A function that replaces the file ``name`` of ``folder`` (``how="file"``), or
    ``folder`` itself (``"folder"``), by a link to a private file (to a folder of them, the
    tokenizer's files and ``name``), each holding :data:`SECRET`."""
    private = folder.parent / "private"
    private.mkdir()
    for n in {*TOKENIZER_FILES, name}:
        (private / n).write_text(SECRET)

    def swap() -> None:
        if how == "file":
            (folder / name).unlink()
            (folder / name).symlink_to(private / name)
        else:
            folder.rename(folder.parent / "moved")
            folder.symlink_to(private, target_is_directory=True)

    return swap


def merge_json(path: str, changes: dict[str, Any], *, none_drops: bool = False) -> None:
    """Merges ``changes`` into the JSON object of the file ``path`` (with ``none_drops``, a
    None value removes its key instead of writing null)."""
    with open(path) as f:
        loaded = json.load(f) | changes
    with open(path, "w") as f:
        json.dump({k: v for k, v in loaded.items() if v is not None or not none_drops}, f)


def tokenizer_copy(out: str, config: dict[str, Any] | None = None,
                   files: dict[str, str | bytes] | None = None, drop: Sequence[str] = (),
                   then: Callable[[str], Any] | None = None) -> str:
    """``out``, made once (a later call returns it as it is) as a copy of the tokenizer
    fixture with ``config`` merged into its ``tokenizer_config.json`` (None removes a key),
    the files of ``drop`` removed, ``files`` (name -> content) written, then ``then(out)``."""
    if not os.path.isdir(out):
        shutil.copytree(TEXT_FIXTURE, out)
        if config is not None:
            merge_json(os.path.join(out, "tokenizer_config.json"), config, none_drops=True)
        for name in drop:
            if os.path.lexists(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
        for name, content in (files or {}).items():
            with open(os.path.join(out, name), "wb" if isinstance(content, bytes) else "w") as f:
                f.write(content)
        if then is not None:
            then(out)
    return out


def peft_copy(source: str, out: str, change: dict[str, Any] | None = None,
              tensors: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> str:
    """``out``, made once (a later call returns it as it is) as a copy of the PEFT adapter
    folder ``source`` with ``change`` merged into its ``adapter_config.json`` and its
    factors replaced by ``tensors(factors)`` (name -> array, both)."""
    if os.path.isdir(out):
        return out
    shutil.copytree(source, out)
    if change is not None:
        merge_json(os.path.join(out, "adapter_config.json"), change)
    if tensors is not None:
        import numpy as np

        from nnx_shard import _safetensors_io as st

        file = os.path.join(out, "adapter_model.safetensors")
        header = st.read_header(file)
        new = tensors({n: st.read_slice(header, n, [slice(None)] * len(i.shape))
                       for n, i in header.tensors.items()})
        os.remove(file)
        st.create(file, {k: (st.dtype_name(v.dtype), v.shape) for k, v in new.items()})
        header = st.read_header(file)
        for k, v in new.items():
            st.write_slice(file, header, k, [slice(None)] * v.ndim, np.asarray(v, order="C"))
    return out


def _attention_mode(mode: str) -> Any:
    import jax.numpy as jnp

    import nnx_shard as ns

    rules = ns.Rules({"batch": "data"}, options={"attention": mode})
    with ns.use("data=8", rules):
        return ns.models.attention(jnp.ones((8, 4, 2, 8)), jnp.ones((8, 4, 2, 8)),
                                   jnp.ones((8, 4, 2, 8)))


def _stage_report(m: Any, carry: Any = None, strategy: Any = "pp") -> Any:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import nnx_shard as ns

    cfg = ns.models.ReferenceConfig(layers=4, scan_layers=True)
    model = nnx.eval_shape(lambda: ns.models.Decoder(cfg, rngs=nnx.Rngs(0)))
    if carry is None:
        carry = jax.ShapeDtypeStruct((8, 16, cfg.embed), jnp.float32)
    strat = ns.strategies.get(strategy) if strategy == "pp" else strategy
    return ns.pipeline.stage_report(model, "stage=4,data=2", strat, carry=carry, microbatches=m)


def _hostile_cache(label: str, content: str | bytes) -> Any:
    import nnx_shard as ns

    path = F.path(f"{label}.json")
    _write_cache(path, content, lambda: ns.planner.auto(
        "tiny", devices=8, batch=8, seq=16, strategies=["dp"], progress=False,
        device_memory=1000, cache=path, compile_fn=_no_compile))
    return ns.planner.auto("tiny", devices=8, batch=8, seq=16, strategies=["dp"],
                              progress=False, device_memory=1000, cache=path,
                              compile_fn=_no_compile)


def _no_compile(c: Any) -> Any:
    raise AssertionError("the cache was not read: a compile ran")


def _write_cache(path: str, content: str | bytes, plan: Callable[[], Any]) -> None:
    """Writes ``content`` as the planner cache; ``ENTRY:x`` puts ``x`` under the key the
    planner looks up (found by one real run with a recording compile_fn)."""
    if isinstance(content, str) and content.startswith("ENTRY:"):
        keys = _cache_keys()
        entry = content[len("ENTRY:"):]
        with open(path, "w") as f:
            f.write("{" + ", ".join(f"{json.dumps(k)}: {entry}" for k in keys) + "}")
    else:
        with open(path, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)


_KEYS: list[str] = []


def _cache_keys() -> list[str]:
    """The planner's cache keys for the request the cache cases make."""
    if not _KEYS:
        import nnx_shard as ns
        from nnx_shard.planner import _cache as cache_mod

        path = F.path("keys_cache.json")
        fake = lambda c: {"total": 100, "temp": 1, "flops": 1e9,  # noqa: E731
                          "collective_bytes": 1e6, "collectives": 1}
        saved = cache_mod.Cache.shared
        cache_mod.Cache.shared = {}
        try:
            ns.planner.auto("tiny", devices=8, batch=8, seq=16, strategies=["dp"],
                               progress=False, device_memory=1000, cache=path, compile_fn=fake)
        finally:
            cache_mod.Cache.shared = saved
        _KEYS.extend(json.load(open(path)))
    return _KEYS


def _unwritable_cache() -> Any:
    """The cache's folder cannot be created: the plan must still come back."""
    import nnx_shard as ns

    blocker = F.file("cache_blocker", "a file where a folder should be")
    plan = ns.planner.auto("tiny", devices=8, batch=8, seq=16, strategies=["dp"],
                              progress=False, device_memory=1000,
                              cache=os.path.join(blocker, "sub", "planner.json"),
                              compile_fn=lambda c: {"total": 100, "temp": 1, "flops": 1e9,
                                                    "collective_bytes": 1e6, "collectives": 1})
    if plan.ranked:
        raise _Documented("cache: the plan came back although its cache could not be "
                          "written (the documented behaviour)")
    return plan


@contextlib.contextmanager
def _fake_child_compiles(keys: list[str] | None = None, *, allowed: bool = True) -> Any:
    """``plan --auto`` in this process without its compile subprocess: every compile
    gets a fixed result (its key recorded in ``keys``), or, with ``allowed=False``,
    fails the case (the cache was expected to answer)."""
    from nnx_shard.planner import _cache as cache_mod
    from nnx_shard.planner import _explore as explore

    real = explore.Search.compile_in_child

    def fake(self: Any, todo: list[Any], bar: Any) -> None:
        if not allowed:
            raise _SweepBroken("a compile ran although the cache holds every entry")
        for c in todo:
            if keys is not None:
                keys.append(self.key_of(c))
            self.done(c, {"total": 100, "temp": 1, "flops": 1e9, "collective_bytes": 1e6,
                          "collectives": 1}, bar)

    saved = cache_mod.Cache.shared
    cache_mod.Cache.shared = {}
    explore.Search.compile_in_child = fake  # type: ignore[method-assign]
    try:
        yield
    finally:
        explore.Search.compile_in_child = real  # type: ignore[method-assign]
        cache_mod.Cache.shared = saved


class _Documented(Exception):
    """Raised by a case whose hostile input has a documented, checked behaviour other
    than an error (e.g. a vector metric written as a list): counted as clear."""


class _SweepBroken(BaseException):
    """A case did not test what it meant to (not an outcome of nnx_shard's)."""


def _cli_with_cache(label: str, content: str | bytes, auto: tuple[str, ...]) -> Any:
    """``plan --auto`` with a hostile cache file under $XDG_CACHE_HOME."""
    home = F.dir(f"xdg_{label}")
    os.makedirs(os.path.join(home, "nnx_shard"), exist_ok=True)
    path = os.path.join(home, "nnx_shard", "planner.json")
    if isinstance(content, str) and content.startswith("ENTRY:"):
        keys: list[str] = []
        with _fake_child_compiles(keys):
            _run_cli(auto, env={"XDG_CACHE_HOME": F.dir(f"xdg_{label}_keys")})
        with open(path, "w") as f:
            f.write("{" + ", ".join(f"{json.dumps(k)}: {content[6:]}" for k in keys) + "}")
        with _fake_child_compiles(allowed=False):
            return _run_cli(auto, env={"XDG_CACHE_HOME": home})
    with open(path, "wb" if isinstance(content, bytes) else "w") as f:
        f.write(content)
    with _fake_child_compiles():
        return _run_cli(auto, env={"XDG_CACHE_HOME": home})


def _cli_unwritable_cache(auto: tuple[str, ...]) -> Any:
    """$XDG_CACHE_HOME is a file: the plan must still be printed (and exit 0)."""
    home = F.file("xdg_blocker", "a file where the cache folder should be")
    with _fake_child_compiles():
        status, out, err = _run_cli(auto, env={"XDG_CACHE_HOME": home})[1:]
    if status == 0 and "dp" in out:
        raise _Documented("cache: the plan was printed although the cache could not be "
                          "written (the documented behaviour)")
    return ("cli", status, out, err)


def _run_cli(argv: Sequence[str], env: dict[str, str] | None = None) -> Any:
    """Runs ``nnx_shard.cli.main(argv)`` with stdout/stderr captured; returns
    ``(status, stdout, stderr)``."""
    from nnx_shard import cli

    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status: Any = cli.main(list(argv))
            except SystemExit as e:
                status = ("SystemExit", e.code)
            except Exception:
                traceback.print_exc()
                status = "exception"
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ("cli", status, out.getvalue(), err.getvalue())


def _explain(argv: tuple[str, ...], bomb: str, deep: str) -> Any:
    files = {
        "exit_factory.py": "import sys\ndef make():\n    sys.exit(0)\n",
        "raise_factory.py": "def make():\n    raise RuntimeError('boom')\n",
        "good_factory.py": ("from flax import nnx\ndef make():\n"
                            "    return nnx.Linear(4, 8, rngs=nnx.Rngs(0))\n"),
    }
    subst = {"DIR": F.dir("rules_dir.toml"), "FIFO": F.fifo("rules_fifo.toml"),
             "BOMB": F.file("cli_bomb.yaml", bomb), "DEEP": F.file("cli_deep.json", deep),
             "BINARY": F.file("cli_bin.json", b"\xff\xfe\x00")}
    real = []
    for a in argv:
        if a.startswith("FILE:"):
            name, _, attr = a[5:].partition(":")
            real.append(f"{F.file(name, files[name])}:{attr}")
        else:
            real.append(subst.get(a, a))
    return _run_cli(real)


def _demo(demo: tuple[str, ...], extra: tuple[str, ...]) -> Any:
    argv = [F.path("demo_out") if a == "OUT" else a for a in demo]
    return _run_cli([*argv, *extra])


# -- running and classifying ---------------------------------------------------------------------


def _nnx_shard_dir() -> str:
    import nnx_shard

    return os.path.dirname(os.path.abspath(nnx_shard.__file__)) + os.sep


def _names_in(text: str, names: Sequence[str]) -> bool:
    low = text.lower()
    return not names or any(n.lower() in low for n in names)


def classify_exception(e: BaseException, names: Sequence[str]) -> tuple[str, str]:
    """``(outcome, why)`` of an exception raised by an API case."""
    from nnx_shard._errors import NnxShardError

    msg = str(e)
    head = f"{type(e).__module__}.{type(e).__name__}: {' '.join(msg.split())[:300]}"
    if isinstance(e, _Documented):
        return CLEAR, head
    if not isinstance(e, Exception):
        return RAW, f"{head} (not an Exception)"
    frames = traceback.extract_tb(e.__traceback__)
    where = frames[-1].filename if frames else ""
    ours = os.path.abspath(where).startswith(_nnx_shard_dir())
    if len(msg) > MAX_MESSAGE:
        return RAW, f"message of {len(msg):,} characters: {head}"
    if isinstance(e, NnxShardError) or (ours and isinstance(
            e, ValueError | TypeError | OSError | ImportError | KeyError | RuntimeError)):
        if not _names_in(msg, names):
            return RAW, f"does not name {' / '.join(names)}: {head}"
        return CLEAR, head
    return RAW, f"{head} (raised in {where}:{frames[-1].lineno if frames else '?'})"


def classify_cli(status: Any, out: str, err: str, names: Sequence[str]) -> tuple[str, str]:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    # launch reports its own checks as "nnx-shard launch: <message>" (exit 2)
    errors = [ln for ln in lines if ln.startswith("nnx-shard") and (
        "error" in ln or ln.startswith("nnx-shard launch: "))]
    head = f"status {status!r}; stderr: {' | '.join(lines)[:300]}; stdout: {out[:100]!r}"
    if "Traceback (most recent call last)" in err or status == "exception":
        return RAW, head
    if status == 2 or status == ("SystemExit", 2):
        if not errors:
            return RAW, f"exit 2 without an 'nnx-shard: error:' line: {head}"
        if len(errors[-1]) > MAX_MESSAGE:
            return RAW, f"error line of {len(errors[-1]):,} characters"
        if not _names_in(errors[-1], names):
            return RAW, f"does not name {' / '.join(names)}: {head}"
        return CLEAR, errors[-1][:300]
    return SILENT, head


def run_case(case: Case) -> dict[str, Any]:
    """Runs one API or in-process command case; the outcome as a JSON-able dict."""
    t0 = time.perf_counter()
    try:
        if case.kind == "cli":
            result = _run_cli(case.argv or ())
        else:
            assert case.fn is not None
            result = case.fn()
    except BaseException as e:
        outcome, why = classify_exception(e, case.names)
    else:
        if isinstance(result, tuple) and len(result) == 4 and result[0] == "cli":
            outcome, why = classify_cli(result[1], result[2], result[3], case.names)
        else:
            outcome, why = SILENT, f"returned {type(result).__name__} {str(result)[:200]!r}"
    return {"name": case.name, "outcome": outcome, "why": why,
            "seconds": round(time.perf_counter() - t0, 2)}


def run_proc(case: Case, timeout: float, tmp: str) -> dict[str, Any]:
    out_dir = os.path.join(tmp, "proc_out")
    argv = [out_dir if a == "OUT" else a for a in case.argv or ()]
    env = {**os.environ, "XDG_CACHE_HOME": tempfile.mkdtemp(prefix="proc_cache_", dir=tmp)}
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "nnx_shard.cli", *argv], capture_output=True,
                           text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"name": case.name, "outcome": HANG, "why": f"over {timeout:g} s",
                "seconds": round(time.perf_counter() - t0, 2)}
    outcome, why = classify_cli(p.returncode, p.stdout, p.stderr, case.names)
    return {"name": case.name, "outcome": outcome, "why": why,
            "seconds": round(time.perf_counter() - t0, 2)}


def cases() -> list[Case]:
    if not CASES:
        _build_cases()
    names = [c.name for c in CASES]
    dup = {n for n in names if names.count(n) > 1}
    assert not dup, f"case names repeat: {sorted(dup)}"
    return CASES


def _worker() -> None:
    """Reads case names from stdin, runs each, writes one JSON line per case to the
    original stdout (everything the cases print goes to stderr)."""
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import warnings

    warnings.simplefilter("ignore")
    by_name = {c.name: c for c in cases()}
    import jax

    from nnx_shard.hf import _peft_config
    from nnx_shard.inference import _template_limits

    # The time bounds of a PEFT config's pattern matching and of a chat template's
    # rendering: the backtracking patterns' and the runaway templates' cases meet them (a
    # clear error naming the field or the limit) as they meet the library's 2 s, which
    # they would spend busy; real templates and patterns take milliseconds.
    _peft_config.MATCH_SECONDS = min(_peft_config.MATCH_SECONDS, 0.25)
    _template_limits.TIME_LIMIT = min(_template_limits.TIME_LIMIT, 0.25)
    jax.devices()  # started before the first case's clock
    results.write("ready\n")
    results.flush()
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        results.write(json.dumps(run_case(by_name[name])) + "\n")
        results.flush()


class _Worker:
    def __init__(self, log: Any, tmp: str) -> None:
        env = dict(os.environ, HOSTILE_TMP=tmp)
        flags = env.get("XLA_FLAGS", "")
        if "--xla_force_host_platform_device_count" not in flags:
            env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
        env["JAX_PLATFORMS"] = "cpu"
        env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="cache_", dir=tmp)
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                  text=True, env=env, start_new_session=True)
        assert self.p.stdout is not None
        ready, _, _ = select.select([self.p.stdout], [], [], 600)
        if not ready or self.p.stdout.readline().strip() != "ready":
            self.kill()
            raise _SweepBroken("the sweep's worker process did not start")

    def run(self, case: Case, timeout: float) -> dict[str, Any] | None:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(case.name + "\n")
        self.p.stdin.flush()
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.p.stdout.readline()
        return json.loads(line) if line else None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()


def sweep(selected: Sequence[Case], *, log: Any = subprocess.DEVNULL,
          fast_timeout: float = FAST_TIMEOUT, slow_timeout: float = SLOW_TIMEOUT,
          progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Runs ``selected``; one result dict per case, in order."""
    results: list[dict[str, Any]] = []
    worker: _Worker | None = None
    tmp = tempfile.mkdtemp(prefix="nnx_shard_hostile_")
    try:
        for case in selected:
            timeout = slow_timeout if case.slow else fast_timeout
            if case.kind == "proc":
                res = run_proc(case, timeout, tmp)
            else:
                if worker is None:
                    worker = _Worker(log, tmp)
                t0 = time.perf_counter()
                res = worker.run(case, timeout)
                if res is None:  # a hang, or the worker died: a fresh one goes on
                    died = worker.p.poll() is not None
                    worker.kill()
                    worker = None
                    res = {"name": case.name, "outcome": RAW if died else HANG,
                           "why": "the worker process died" if died else f"over {timeout:g} s",
                           "seconds": round(time.perf_counter() - t0, 2)}
            results.append(res)
            if progress is not None:
                progress(res)
    finally:
        if worker is not None:
            worker.kill()
        shutil.rmtree(tmp, ignore_errors=True)  # the sweep's own folder, nothing else
    return results


def summary(results: Sequence[dict[str, Any]]) -> dict[str, int]:
    counts = {k: 0 for k in (CLEAR, RAW, HANG, SILENT)}
    for r in results:
        counts[r["outcome"]] += 1
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fast", action="store_true", help="only the cases CI runs")
    parser.add_argument("--match", default="", help="only cases whose name contains this")
    parser.add_argument("--json", default=None, help="write every result to this file")
    parser.add_argument("--show", choices=("failures", "all"), default="failures")
    parser.add_argument("--log", default=None, help="the worker's stderr goes here")
    args = parser.parse_args(argv)
    if args.worker:
        _worker()
        return 0
    selected = [c for c in cases() if (not args.fast or not c.slow) and args.match in c.name]
    log = open(args.log, "w") if args.log else subprocess.DEVNULL
    t0 = time.perf_counter()

    def show(r: dict[str, Any]) -> None:
        if args.show == "all" or r["outcome"] != CLEAR:
            print(f"{r['outcome']:<7} {r['seconds']:>6.1f}s  {r['name']}: {r['why']}",
                  flush=True)

    results = sweep(selected, log=log, progress=show)
    counts = summary(results)
    api_n = sum(1 for c in selected if c.argv is None)
    print(f"\n{len(results)} hostile calls ({api_n} through the API, "
          f"{len(results) - api_n} command lines) in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{v} {k}" for k, v in counts.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": counts, "results": results}, f, indent=1)
    return 0 if counts[CLEAR] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
