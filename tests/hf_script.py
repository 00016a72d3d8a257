"""Multi-process Hugging Face checkpoint jobs, run by tests/hf/test_hf.py through the
launcher (``nnx-shard launch -n 2 --devices-per-process 4 -- python tests/hf_script.py
MODE ...``).

Modes:
  load OUT   fsdp over data=8 across the processes: load tests/fixtures/hf_llama
             (stacked layers), count the bytes each process reads, compute the
             logits of the fixture's tokens; process i writes OUT.i.json (its bytes
             read, the checkpoint's bytes, the shardings) and process 0 OUT.npz
  save DIR   load the fixture as above and save it back with save_safetensors
             from both processes into DIR (split over several files)
  load+save OUT DIR   both, from one load (one job: each costs its processes' start)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).parent / "fixtures" / "hf_llama"


def load() -> tuple[object, object, object, dict[str, int]]:
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard import _safetensors_io as safetensors_io
    from nnx_shard.models import Decoder, DecoderConfig

    counted = {"bytes": 0}
    read = safetensors_io.read_slice

    def counting(header, name, index):  # type: ignore[no-untyped-def]
        out = read(header, name, index)
        counted["bytes"] += out.nbytes
        return out

    safetensors_io.read_slice = counting
    s = ns.strategies.get("fsdp")
    mesh = s.make_mesh(8)
    cfg = DecoderConfig.from_hf(FIXTURE, scan_layers=True)
    model = ns.hf.load_safetensors(FIXTURE, ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)),
                                                          mesh, s))
    safetensors_io.read_slice = read
    return model, mesh, s, counted


def main(argv: list[str]) -> int:
    import nnx_shard as ns

    coords = ns.distributed.initialize()
    import jax
    from flax import nnx

    from nnx_shard import _safetensors_io as safetensors_io

    modes = argv[0].split("+")
    model, mesh, strategy, counted = load()
    if "load" in modes:
        out = argv[1]
        files = sorted(str(p) for p in FIXTURE.glob("*.safetensors"))
        total = sum(t.nbytes for t in safetensors_io.read_header(*files).tensors.values())
        q = model.blocks.attn.q.get_value()
        info = {"read": counted["bytes"], "total": total,
                "q_spec": str(q.sharding.spec), "local_shards": len(q.addressable_shards)}
        Path(f"{out}.{coords.process_id}.json").write_text(json.dumps(info))
        expected = np.load(FIXTURE / "expected.npz")
        host = np.tile(expected["tokens"], (4, 1))
        sharding = jax.sharding.NamedSharding(mesh, jax.P("data"))
        tokens = jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
        with ns.use(mesh, strategy.rules):
            logits = nnx.jit(lambda m, t: m(t))(model, tokens)
        logits = ns.distributed.gather(logits)
        if ns.distributed.is_main():
            np.savez(f"{out}.npz", logits=logits)
        print(f"read {counted['bytes']} of {total} bytes", flush=True)
    if "save" in modes:
        ns.hf.save_safetensors(argv[-1], model, max_shard_bytes=30_000)
        print("saved", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
