"""Each model family's error against transformers, fixture by fixture.

Loads every Hugging Face fixture under ``tests/fixtures`` (the ``hf_*`` families, the
mixtures of experts under ``moe/`` and the rotary scalings under ``rope_scaling/``)
with ``ns.hf.load_pretrained`` on one device, runs the token ids its fixture script
gave transformers, and prints ``max|ours - transformers| / max|transformers|`` of the
logits per fixture (float32). The tests assert bounds on the same comparisons
(``tests/hf``, ``tests/models``); this prints the figures. ``--save OUT.npz`` keeps the
logits, to compare two trees bit for bit.

Run (about a minute on 2 CPU cores)::

    .venv/bin/python benchmarks/family_errors.py
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from _common import machine, print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "family_errors.json"
# (token ids, logits) keys of the fixtures' expected.npz files.
PAIRS = (("tokens", "logits"), ("ids", "logits"), ("tokens_short", "logits_short"),
         ("tokens_long", "logits_long"))


def fixtures() -> list[Path]:
    """The fixture folders that hold a checkpoint and transformers' logits."""
    root = ROOT / "tests" / "fixtures"
    dirs = (sorted(root.glob("hf_*")) + sorted((root / "moe").glob("*"))
            + sorted((root / "rope_scaling").glob("*")))
    return [d for d in dirs if (d / "config.json").exists() and (d / "expected.npz").exists()]


def errors() -> tuple[dict[str, float], dict[str, Any]]:
    """Per fixture and token set: the relative error, and our logits."""
    import jax.numpy as jnp
    import numpy as np

    import nnx_shard as ns

    errs: dict[str, float] = {}
    logits: dict[str, Any] = {}
    for d in fixtures():
        expected = np.load(d / "expected.npz")
        pairs = [(t, lg) for t, lg in PAIRS
                 if t in expected and lg in expected and expected[t].ndim == 2]
        if not pairs:
            continue
        model = ns.hf.load_pretrained(d, mesh="data=1", rules=ns.strategies.get("dp").rules)
        for tokens, key in pairs:
            ours = np.asarray(model(jnp.asarray(expected[tokens])))
            ref = expected[key]
            name = f"{d.parent.name}/{d.name}/{tokens}"
            errs[name] = float(np.abs(ours - ref).max() / np.abs(ref).max())
            logits[name.replace("/", "__")] = ours
    return errs, logits


def main() -> None:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    ap.add_argument("--save", type=Path, help="also save the logits to this .npz")
    args = ap.parse_args()
    errs, logits = errors()
    print(f"max|ours - transformers| / max|transformers|, one device; {machine()}")
    print_table(["fixture", "error"], [[name, f"{e:.2e}"] for name, e in errs.items()])
    if args.save:
        np.savez(args.save, **logits)
    write_json(args.out, {"machine": machine(), "errors": errs,
                          "measure": "max|ours - transformers| / max|transformers| of the logits"})


if __name__ == "__main__":
    main()
