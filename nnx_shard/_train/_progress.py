"""fit's progress bar: one tqdm bar per job (process 0), redrawn on a terminal, a
widget in a notebook, a line every :data:`LOG_INTERVAL_S` seconds in a log file."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, TextIO

import jax

__all__ = ["LOG_INTERVAL_S", "Progress"]


class _LogLines:
    """A log file (not a terminal) seen by tqdm: each redraw becomes its own line.

    tqdm redraws with ``\\r``, which a log file or CI console keeps as one ever
    longer line; here every redraw is written as one line instead.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.open = False  # a status line written, its newline not yet

    def write(self, s: str) -> None:
        text = s.replace("\r", "").rstrip(" ")
        if not text:
            return
        if self.open:  # the previous redraw's line ends here
            self.stream.write("\n")
            self.open = False
        if text != "\n":
            self.stream.write(text)
            self.open = True

    def flush(self) -> None:
        self.stream.flush()


# Seconds between redraws of a bar written to a log rather than a terminal: a
# day-long job writes ~3,000 lines, not one per fused call.
LOG_INTERVAL_S = 30.0


class Progress:
    """One tqdm bar per job (process 0): steps, loss, steps/s, examples/s.

    A terminal gets a bar redrawn at most 10 times a second; a notebook a widget
    (``tqdm.auto``, when ipywidgets is installed); any other stream (a log file,
    CI output) one line at the start, one every :data:`LOG_INTERVAL_S` seconds
    and one at the end.
    """

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.bar: Any = None
        # One bar per job: with several processes, only process 0 reports.
        if not enabled or jax.process_index() != 0:
            return
        from tqdm import std
        from tqdm.auto import tqdm
        from tqdm.notebook import tqdm_notebook

        if stream is None and issubclass(tqdm, tqdm_notebook):  # a notebook with ipywidgets
            self.bar = tqdm(total=total, unit="step", bar_format=_BAR)
            return
        isatty = getattr(stream if stream is not None else sys.stderr, "isatty", None)
        # A notebook without ipywidgets renders stderr's \r redraws in place, like a terminal.
        tty = bool(isatty is not None and isatty()) or (
            stream is None and "ipykernel.zmqshell" in sys.modules)
        stream = stream if stream is not None else sys.stderr
        shape: dict[str, Any] = {"dynamic_ncols": True}
        if tty:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                if 0 in os.get_terminal_size(stream.fileno()):
                    # A terminal that reports no size (docker exec, some CI runners):
                    # tqdm would take it as zero rows and draw nothing.
                    shape = {"ncols": 100, "nrows": 20}
        self.bar = std.tqdm(
            total=total, unit="step", bar_format=_BAR,
            file=stream if tty else _LogLines(stream),
            mininterval=0.1 if tty else LOG_INTERVAL_S, miniters=1,
            ascii=None if tty else True, **(shape if tty else {}),
        )

    def update(self, step: int, loss: float, steps_s: float, examples_s: float) -> None:
        if self.bar is None:
            return
        self.bar.set_postfix_str(
            f"loss {loss:.4g}, {steps_s:,.1f} steps/s, {examples_s:,.0f} examples/s",
            refresh=False,
        )
        self.bar.update(step - self.bar.n)  # the last state is drawn by close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# tqdm's own rate counts wall time since the start, compilation included: the
# postfix carries the rate of the last fused call instead.
_BAR = "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"
