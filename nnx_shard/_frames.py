"""Per-thread stacks of frames: what an enclosing call tells the code it traces.

Several parts of the library hand facts down a call chain they do not own: the
active ``(mesh, rules)`` of :func:`nnx_shard.use`, the number of microbatches a
fused step splits its batch into, whether a traced step called the op its
strategy asks for. Each pushes a frame for the duration of a ``with`` block;
code further down reads the innermost one. Frames are per thread, so two
threads tracing at once never see each other's.

>>> frames: Frames[str] = Frames()
>>> with frames.push("outer"), frames.push("inner"):
...     frames.top(), list(frames)
('inner', ['outer', 'inner'])
>>> frames.top() is None, bool(frames)
(True, False)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["Frames"]

T = TypeVar("T")


class Frames(threading.local, Generic[T]):
    """A stack of frames of type ``T``, one per thread (each thread starts empty).

    ``push(frame)`` is a context manager that puts ``frame`` on top for the block
    and takes it off after, whatever happens inside; ``top()`` is the innermost
    frame or ``None``; iterating goes from the outermost frame in.
    """

    def __init__(self) -> None:
        self.stack: list[T] = []

    @contextlib.contextmanager
    def push(self, frame: T) -> Iterator[T]:
        self.stack.append(frame)
        try:
            yield frame
        finally:
            self.stack.pop()

    def top(self) -> T | None:
        return self.stack[-1] if self.stack else None

    def __iter__(self) -> Iterator[T]:
        return iter(list(self.stack))

    def __bool__(self) -> bool:
        return bool(self.stack)
