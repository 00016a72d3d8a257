"""Request functions for :class:`nnx_shard._simulated.Workers` children in the tests.

Standard library only: a child that imports this module starts without JAX, so a
test of the children's protocol (answers, timeouts, deaths) does not pay seconds
of CPU per child for an import it never uses.
"""

from __future__ import annotations

import os
import sys
import time


def sleep_request(request: dict) -> dict:
    """Sleeps ``request["s"]`` seconds and answers with its process id. With
    ``request["gate"]`` (a path) it instead waits until that file exists, up to ``s``
    seconds.

    >>> sleep_request({"s": 0.0})["slept"]
    0.0
    """
    gate = request.get("gate")
    if gate is None:
        time.sleep(request["s"])
    else:
        end = time.monotonic() + request["s"]
        while not os.path.exists(gate) and time.monotonic() < end:
            time.sleep(0.01)
    return {"slept": request["s"], "pid": os.getpid()}


def die_request(request: dict) -> dict:
    """Exits with status 3 when ``request["die"]``, else answers with its process id.

    >>> die_request({"die": False})["pid"] == os.getpid()
    True
    """
    if request.get("die"):
        print("dying on purpose", file=sys.stderr, flush=True)
        os._exit(3)
    return {"pid": os.getpid()}
