"""The one execution context (nnx_shard._mesh._context): what use, multistep,
value_and_grad and the pipeline hand down is one frozen value in one ContextVar,
entered as a replace of the one outside, per thread, restored after errors; the
options it exposes are the one table's; and no other module keeps state of its own."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import threading
from pathlib import Path

import pytest

import nnx_shard as ns
from nnx_shard._errors import UsageError
from nnx_shard._mesh import Context, called, context, current, entered, option, use, watching
from nnx_shard._rules import OPTIONS, Rules

PACKAGE = Path(ns.__file__).parent
CONTEXT_MODULE = PACKAGE / "_mesh" / "_context.py"

#: ContextVars that are no execution state, each with why it is not the context's:
#: the chat template's per-render budget (``_template_limits``) and output tracker (the
#: sandbox's own bookkeeping of one rendering), and the measuring switch of the grouped
#: matmul's loop.
OTHER_CONTEXTVARS = {"inference/_template_limits.py": 1, "inference/_chat_template.py": 1,
                     "models/_grouped.py": 1}

#: Per-thread state still kept elsewhere; the list only shrinks. QLoRA on stock layers
#: finds the quantized kernel a layer read whole through a per-thread weak reference:
#: an adapter holding its kernel would claim the kernel's state path (NNX walks a
#: module's attributes sorted, and ``dot_general`` sorts before ``kernel``).
STILL_PER_THREAD = {"_quantized.py": {"threading.local": 1}}


def _calls(tree: ast.AST) -> dict[str, int]:
    found = {"threading.local": 0, "Frames": 0, "ContextVar": 0}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "local" and getattr(
                node.value, "id", None) == "threading":
            found["threading.local"] += 1
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in ("Frames", "ContextVar"):
                found[name] += 1
    return found


def test_one_module_keeps_the_execution_state():
    where: dict[str, dict[str, int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found = {k: v for k, v in _calls(ast.parse(path.read_text(encoding="utf-8"))).items()
                 if v}
        if found:
            where[path.relative_to(PACKAGE).as_posix()] = found
    assert where.pop("_mesh/_context.py") == {"ContextVar": 1}
    others = {p: f for p, f in where.items() if f != {"ContextVar": OTHER_CONTEXTVARS.get(p)}
              and f != STILL_PER_THREAD.get(p)}
    assert others == {}, f"per-thread state outside nnx_shard/_mesh/_context.py: {others}"
    assert not (PACKAGE / "_frames.py").exists()


def test_the_scan_sees_each_kind_of_state():
    src = ("import threading, contextvars\nx = threading.local()\nf = Frames()\n"
           "v = contextvars.ContextVar('v')\n")
    assert _calls(ast.parse(src)) == {"threading.local": 1, "Frames": 1, "ContextVar": 1}


def test_the_context_is_frozen_and_empty_outside_every_block():
    ctx = context()
    assert ctx == Context() and current() is None and dict(ctx.options) == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.microbatches = 2  # type: ignore[misc]


def test_nested_blocks_replace_the_context_outside_them():
    rules = Rules({"batch": "data"}).with_options(attention="ring")
    with use("data=8", rules) as mesh:
        outer = context()
        with entered(microbatches=4) as inner:
            assert (inner.mesh, inner.rules, inner.microbatches) == (mesh, rules, 4)
            assert option("attention") == "ring"
            with use("data=4,model=2", Rules({})):  # a new mesh keeps the step's settings
                assert context().microbatches == 4 and option("attention") == "local"
                assert dict(context().mesh.shape) == {"data": 4, "model": 2}
            assert context() is inner
        assert context() is outer and outer.microbatches is None
    assert context() == Context()


def test_an_exception_inside_leaves_the_outer_context():
    with use("data=8", Rules({"batch": "data"})):
        outer = context()
        with pytest.raises(RuntimeError, match="inside"), entered(microbatches=3), \
                use("data=2,model=4", Rules({})):
            raise RuntimeError("inside")
        assert context() is outer
    assert context() == Context()


def test_two_threads_each_see_their_own_use():
    barrier = threading.Barrier(2)
    seen: dict[str, tuple[object, ...]] = {}

    def run(name: str, spec: str, m: int) -> None:
        assert context() == Context()  # a new thread starts with no context
        with use(spec, Rules({"batch": "data"})), entered(microbatches=m):
            barrier.wait()  # both threads are inside their blocks now
            seen[name] = (dict(context().mesh.shape), context().microbatches)
            barrier.wait()

    threads = [threading.Thread(target=run, args=("a", "data=8", 2)),
               threading.Thread(target=run, args=("b", "data=4,model=2", 4))]
    with entered(microbatches=7):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert context().microbatches == 7
    assert seen == {"a": ({"data": 8}, 2), "b": ({"data": 4, "model": 2}, 4)}


def test_two_asyncio_tasks_each_see_their_own_context():
    async def one(m: int) -> int | None:
        with entered(microbatches=m):
            await asyncio.sleep(0)
            return context().microbatches

    async def both() -> list[int | None]:
        return list(await asyncio.gather(one(2), one(3)))

    assert asyncio.run(both()) == [2, 3]


def test_calls_are_recorded_for_the_blocks_that_watch():
    called("attention")  # nothing watching: nothing kept
    with watching() as step:
        called("value_and_grad")
        with watching() as inner:
            called("pipeline")
        called("attention")
    assert ("value_and_grad" in step, "pipeline" in step, "attention" in step) == (
        True, True, True)
    assert ("pipeline" in inner, "attention" in inner, "value_and_grad" in inner) == (
        True, False, False)
    assert context().calls is None


def test_option_reads_the_table_and_refuses_unknown_names():
    # (ops registered by other tests add rows of their own)
    assert {name: option(name) for name in ("attention", "collective_matmul", "pipeline")} == {
        "attention": "local", "collective_matmul": None, "pipeline": None}
    assert {"attention", "collective_matmul", "pipeline"} <= set(OPTIONS)
    assert option("collective_matmul", False) is False  # a reader's own default
    with pytest.raises(UsageError, match=r"option 'atention' is not an execution option\. Did "
                       r"you mean 'attention'\? Known options: attention, collective_matmul, "
                       r"(.*, )?pipeline"):
        option("atention")
    with use("data=8", Rules({"batch": "data"}, options={"collective_matmul": True})):
        assert option("collective_matmul") is True and option("attention") == "local"
