"""A multi-process training script, run by tests/test_distributed.py and test_launch.py.

Every process runs it (``nnx-shard launch -n 2 -- python tests/distributed_script.py
train OUT``); the tests also import it and call :func:`train` in their own process,
on 8 simulated devices, for the single-process reference.

Modes:
  train OUT          fused fsdp training of the tiny reference transformer; process 0 writes OUT (.npz)
  save DIR OUT [FROM RESTORED [DILOCO]]
                     print as check does; with FROM, restore FROM first (as restore FROM
                     RESTORED); then train (as train OUT) and every process saves to DIR;
                     with DILOCO, then train DiLoCo (:func:`diloco`); process 0 writes DILOCO
  restore DIR OUT    restore DIR onto fresh abstract targets; OUT holds the params
  die                process 1 kills itself after a first collective; the others keep going
  check              initialize, print the coordinates and devices
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import numpy as np

STEPS, STEPS_PER_CALL, GLOBAL_BATCH = 6, 3, 16
MESH = "data=8"
# Auto axes: XLA inserts the all-gathers fsdp needs (Explicit axes want them spelled out).
AXIS_TYPES = "auto"


def fsdp_rules() -> Any:
    from nnx_shard import strategies

    return strategies.get("fsdp").rules


def factory() -> Any:
    """The tiny reference transformer."""
    from flax import nnx

    from nnx_shard.models import Decoder, get_config

    return lambda: Decoder(get_config("tiny"), rngs=nnx.Rngs(0))


def loss(model: Any, batch: dict[str, Any]) -> Any:
    from nnx_shard.models import lm_loss

    return lm_loss(model, batch)


def build(abstract: bool = False) -> tuple[Any, ...]:
    import optax

    import nnx_shard as ns

    mesh = ns.make_mesh(MESH, axis_types=AXIS_TYPES)
    rules = fsdp_rules()
    init = ns.abstract_init if abstract else ns.sharded_init
    model = init(factory(), mesh, rules)
    opt = ns.sharded_optimizer(model, optax.adam(1e-2), mesh, rules)
    return mesh, rules, model, opt


def global_batches(steps: int) -> list[dict[str, np.ndarray]]:
    """The same global batches on every process (each then keeps its own rows)."""
    from nnx_shard.models import get_config

    cfg = get_config("tiny")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab, size=(steps, GLOBAL_BATCH, cfg.length + 1), dtype=np.int32)
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def params_of(model: Any) -> dict[str, np.ndarray]:
    import jax
    from flax import nnx

    import nnx_shard as ns

    state = ns.distributed.gather(nnx.state(model, nnx.Param))
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def train(steps: int = STEPS) -> tuple[np.ndarray, dict[str, np.ndarray], Any, Any]:
    import nnx_shard as ns

    mesh, rules, model, opt = build()
    trainer = ns.Trainer(model, opt, loss, mesh=mesh, rules=rules, steps_per_call=STEPS_PER_CALL)
    data = [ns.distributed.local_part(b, mesh, rules) for b in global_batches(steps)]
    history = trainer.fit(data, steps, progress=False)
    return np.asarray(history["loss"]), params_of(model), model, opt


DILOCO_STEPS, DILOCO_PER_CALL, DILOCO_INNER, DILOCO_BATCH = 4, 2, 3, 8


def diloco() -> dict[str, np.ndarray]:
    """DiLoCo (``ns.DiLoCo``, inner AdamW, the default outer optimizer) of a 1-layer tiny
    transformer under ``hsdp`` (replica=2 x data=4; on 2 processes, one replica each):
    two fused calls of 2 steps, so the compiled call holds the sync, run at step 3 (in the
    second call), and the replicas have parted again by step 4. Returns, gathered on every
    process: ``__loss__`` (per step and replica, ``[K, R]``), ``__where__`` (the process of
    every device holding each replica, ``[R, data]``), ``['anchor']...`` (the model's
    parameters) and ``['replicas']...`` (every replica's, ``[R, ...]``)."""
    import dataclasses

    import jax
    import optax
    from flax import nnx

    import nnx_shard as ns
    from nnx_shard.models import Decoder, get_config

    hsdp = ns.strategies.get("hsdp")
    mesh = hsdp.make_mesh()
    cfg = dataclasses.replace(get_config("tiny"), layers=1)  # depth proves nothing here
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, hsdp)
    trainer = ns.DiLoCo(model, optax.adamw(1e-2), inner_steps=DILOCO_INNER)
    where: dict[int, list[int]] = {}
    for x in jax.tree.leaves(nnx.state(trainer.replicas)):
        placed: dict[int, list[int]] = {}
        for device, index in x.sharding.devices_indices_map(x.shape).items():
            placed.setdefault(index[0].start or 0, []).append(device.process_index)
        assert not where or placed == where, (placed, where)  # every leaf alike
        where = placed
    fused = ns.multistep(lambda d, b: {"loss": d.step(loss, b)})
    tokens = np.random.default_rng(1).integers(
        0, cfg.vocab, (DILOCO_STEPS, DILOCO_BATCH, cfg.length + 1), dtype=np.int32)
    rows = ns.distributed.process_slice(DILOCO_BATCH, mesh, hsdp.rules)  # this process's
    losses = []
    with ns.use(mesh, hsdp.rules):
        for k in range(0, DILOCO_STEPS, DILOCO_PER_CALL):
            part = tokens[k:k + DILOCO_PER_CALL, rows]
            batch = ns.shard_batch({"inputs": part[..., :-1], "targets": part[..., 1:]}, mesh,
                                   hsdp.rules, ("batch", "length"), steps=True)
            losses.append(fused(trainer, batch)["loss"])
    assert int(trainer.count[...]) == DILOCO_STEPS and fused.traces == 1
    # One program replicates every result (a gather of each leaf compiles one per shape).
    everywhere = jax.jit(lambda t: t, out_shardings=jax.sharding.NamedSharding(mesh, jax.P()))
    result = ns.distributed.gather(everywhere({
        "anchor": nnx.to_pure_dict(nnx.state(model, nnx.Param)), "losses": losses,
        "replicas": nnx.to_pure_dict(nnx.state(trainer.replicas))}))
    return {"__loss__": np.concatenate(result.pop("losses")),
            "__where__": np.asarray([sorted(where[r]) for r in sorted(where)]),
            **{jax.tree_util.keystr(p): v
               for p, v in jax.tree_util.tree_flatten_with_path(result)[0]}}


def write(out: str, losses: np.ndarray | None, params: dict[str, np.ndarray]) -> None:
    import nnx_shard as ns

    if ns.distributed.is_main():
        extra = {} if losses is None else {"__loss__": losses}
        np.savez(out, **extra, **params)


def restore(directory: str, out: str) -> None:
    """Restores ``directory`` onto fresh abstract targets; process 0 writes OUT."""
    import nnx_shard as ns

    _, _, model, opt = build(abstract=True)
    model, opt, _ = ns.restore(directory, model=model, optimizer=opt)
    write(out, None, {**params_of(model), "__step__": np.asarray(opt.step[...])})


def main(argv: list[str]) -> int:
    import nnx_shard as ns

    coords = ns.distributed.initialize()
    import jax

    mode = argv[0]
    if mode in ("check", "save"):
        print(f"process {coords.process_id} of {coords.num_processes} from {coords.source}; "
              f"{jax.local_device_count()} local of {jax.device_count()} devices", flush=True)
        rows = ns.distributed.process_slice(GLOBAL_BATCH, ns.make_mesh(MESH), fsdp_rules())
        print(f"rows {rows.start}:{rows.stop} of {GLOBAL_BATCH}", flush=True)
        # hsdp's hybrid meshes (no compilation): which process holds each place.
        for mesh in (ns.strategies.get("hsdp").make_mesh(),
                     ns.make_mesh("data=4,replica=2", across="replica")):
            where = [[d.process_index for d in row] for row in mesh.devices]
            shape = ",".join(f"{k}={v}" for k, v in mesh.shape.items())
            print(f"hybrid {shape} processes {where}", flush=True)
    if mode == "train":
        losses, params, _, _ = train()
        write(argv[1], losses, params)
        print(f"losses {losses.tolist()}", flush=True)
    elif mode == "save":
        # One job proves several things: each process costs seconds just to start JAX.
        if len(argv) > 3:
            restore(argv[3], argv[4])
        losses, params, model, opt = train()
        ns.save(argv[1], STEPS, model=model, optimizer=opt)
        write(argv[2], losses, params)
        print(f"losses {losses.tolist()}", flush=True)
        if len(argv) > 5:
            result = diloco()
            if ns.distributed.is_main():
                np.savez(argv[5], **result)
    elif mode == "restore":
        restore(argv[1], argv[2])
    elif mode == "die":
        import jax.numpy as jnp

        mesh = ns.make_mesh(MESH)
        x = jax.device_put(jnp.ones((8,)), jax.sharding.NamedSharding(mesh, jax.P("data")))
        total = jax.jit(jnp.sum)
        print(f"sum {float(total(x))}", flush=True)
        if coords.process_id == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # blocks in the collective once the peer is gone
            total(x).block_until_ready()
            time.sleep(0.05)
    elif mode != "check":
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
