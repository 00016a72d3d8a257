"""The decoder's activation bytes per device, by formula (every family's): the estimate ``nnx-shard plan`` and the
planner print next to XLA's compiled figures.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from nnx_shard._axes import abstract_mesh, entry_axes
from nnx_shard._errors import ShardingError
from nnx_shard._rules import as_rules

__all__ = ['ACTIVATION_FORMULA', 'activation_bytes']

ACTIVATION_FORMULA = (
    "per device, no rematerialization: tokens/device x [layers x (p(4e/Dl + 4hk/Dh + 2m'/Dm) "
    "+ 4hs/Dh) + max(2pe/Dl + 8V/Dv, X)], tokens/device = batch x seq / Db; p = activation bytes "
    "(the compute dtype), e = embed, h = heads, k = head_dim, m' = mlp (x top_k x "
    "capacity_factor for the reference model's experts; the Llama family's MoE "
    "layers: the expert's width x top_k, or under expert parallelism, the experts over P "
    "devices that also split the tokens, x min(P x top_k, experts): each device computes "
    "the slots every peer may send it, the dropless worst case), s = seq, V = vocab, "
    "D* = devices the rules shard batch, length, heads, mlp, vocab over. "
    "Per layer: norm inputs and outputs (4e), q/k/v and attention output (4hk; for the "
    "Llama family q and the output (2hk) with k/v at kv_heads g (2gk), never repeated, "
    "plus q/k norm inputs (hk + gk) with Qwen3's qk_norm), MLP hidden before and after "
    "GELU (2m'; Llama's SwiGLU keeps 4m': gate, its SiLU, up and their product), "
    "float32 attention probabilities (4hs) with the dense "
    "attention kernel (ReferenceConfig.attention='dense'), or only a float32 log-sum-exp "
    "per row and head (4h) with the memory-efficient ones (blockwise, cudnn, auto: the "
    "default; their backward pass recomputes the probabilities block by block, in a few "
    "float32 [batch, heads, 512, 512] tiles that are not counted); plus the residual input "
    "and float32 logits and their gradient (8V). With --remat full only each "
    "block's input is kept (layers x p x e/Dl per token) plus one layer's activations and the "
    "logits; dots and offload count as none. Under context parallelism the sequence stays "
    "split through the block, so Dh, Dm and Dv include the length axes, and the ring "
    "(attention='ring') keeps no probabilities whatever the kernel (4h, as above). "
    "X = 0 except under expert parallelism (the Llama family's MoE layers, experts over P "
    "devices): X = e x (min(P x top_k, experts) x (3p + 24) + 12 top_k), the dispatch and "
    "combine buffers one MoE layer holds while it runs, as XLA's CPU compile keeps them: "
    "over every row a device may receive, three embedding-wide in the compute dtype (the "
    "grouped matmuls' outputs) and six in 32 bits (the send and combine scatters and the "
    "scatter-adds of their gradients, which XLA CPU widens to 32 bits and allocates "
    "before the layer's loops), and three 32-bit ones over each token's top_k slots; "
    "the logits are not alive then, so the larger of the two counts; plus, where FSDP "
    "shards the experts' embed dimension (fsdp_ep), one layer's local experts' weights "
    "gathered in the compute dtype (p x matrices x experts/P x e x expert mlp / Dm)."
)


def _divisor(rules: Any, names: tuple[Any, ...], shape: tuple[int, ...], mesh: Any,
             *dims: int) -> int:
    """How many devices share the dimensions ``dims`` of an activation."""
    spec = tuple(rules.spec(names, shape=shape, mesh=mesh, path="activation"))
    axes: list[str] = []
    for dim in dims:
        entry = spec[dim] if dim < len(spec) else None
        axes += entry_axes(entry)
    return math.prod(dict(mesh.shape)[a] for a in axes)


def _mlp_width(cfg: Any, ep: int = 1) -> float:
    """The MLP's hidden width per token, averaged over the layers: the reference
    family's experts hold ``top_k x capacity_factor`` slots per token; the Hugging Face
    families' (Mixtral, Qwen3-MoE) exactly ``top_k``, each ``expert_mlp`` wide, sorted by
    expert with no capacity, and Qwen3-MoE's ``mlp_only_layers`` stay dense. Under
    expert parallelism over ``ep`` devices each device computes a receive buffer with
    room for ``min(top_k, experts / ep)`` slots of every peer's token (nothing dropped):
    ``min(ep x top_k, experts)`` slots per local token."""
    if not any(cfg.moe_layers()):
        return float(cfg.mlp)
    if cfg.capacity_factor is not None:
        return float(cfg.mlp * cfg.top_k * cfg.capacity_factor)
    moe = sum(cfg.moe_layers())
    slots = min(ep * cfg.top_k, cfg.experts)
    return (moe * cfg.expert_mlp * slots + (cfg.layers - moe) * cfg.mlp) / cfg.layers


def _expert_devices(cfg: Any, rules: Any, mesh: Any, batch: int, seq: int) -> int:
    """How many devices the expert-parallel layer spreads the experts over: the size of
    the mesh axes of ``expert`` when they also split the tokens and divide the experts
    (as ``nnx_shard.models._expert_parallel.expert_plan`` decides), else 1 (the layer
    gathers)."""
    if not any(cfg.moe_layers()) or cfg.capacity_factor is not None:
        return 1
    try:
        expert = tuple(rules.spec(("expert",), shape=(cfg.experts,), mesh=mesh,
                                  path="activation"))
        tokens = tuple(rules.spec(("batch", "length"), shape=(batch, seq), mesh=mesh,
                                  path="activation"))
    except ShardingError:
        return 1
    ep = entry_axes((*expert, None)[0])
    split = {a for entry in tokens for a in entry_axes(entry)}
    p = math.prod(dict(mesh.shape)[a] for a in ep)
    return p if ep and set(ep) <= split and cfg.experts % p == 0 else 1


def activation_bytes(cfg: Any, rules: Any, sizes: dict[str, int], batch: int, seq: int,
                     remat: str = "none") -> int:
    """Estimated activation bytes per device of one training step of
    :class:`nnx_shard.models.Decoder` (``cfg`` a ``ReferenceConfig`` or ``DecoderConfig``; see ``ACTIVATION_FORMULA``).

    >>> import dataclasses
    >>> from nnx_shard.models import get_config
    >>> from nnx_shard._rules import Rules
    >>> cfg = get_config("tiny")   # embed 32, heads 4 x 8, mlp 64, vocab 128, 2 layers, f32
    >>> tokens = 4 * 16 // 2                 # batch over data=2
    >>> layer = 4 * (4 * 32 + 4 * 4 * 8 + 2 * 64) + 4 * 4   # p=4 bytes; log-sum-exp 4h
    >>> edges = 2 * 4 * 32 + 8 * 128
    >>> activation_bytes(cfg, Rules({"batch": "data"}), {"data": 2}, batch=4, seq=16) == (
    ...     tokens * (2 * layer + edges))
    True
    >>> dense = dataclasses.replace(cfg, attention="dense")   # probabilities 4hs
    >>> activation_bytes(dense, Rules({"batch": "data"}), {"data": 2}, batch=4, seq=16) == (
    ...     tokens * (2 * (layer + 4 * 4 * 16 - 4 * 4) + edges))
    True
    >>> from nnx_shard.models import get_config   # SwiGLU: 4 x mlp, not 2
    >>> llama = get_config("llama-tiny")    # embed 32, heads 4 x 8, 2 kv heads, mlp 64
    >>> gqa = 4 * (2 * 4 * 8 + 2 * 2 * 8) - 4 * (4 * 4 * 8)      # q, o and k/v at 2 heads
    >>> activation_bytes(llama, Rules({"batch": "data"}), {"data": 2}, batch=4, seq=16) == (
    ...     tokens * (2 * (layer + gqa + 4 * 2 * 64) + edges))
    True
    """
    mesh = abstract_mesh(sizes)
    rules = as_rules(rules)
    # A name the table does not mention is replicated, as for any activation.
    rules = rules | {n: None for n in ("batch", "length", "heads", "kv", "mlp", "vocab", "embed")
                     if n not in rules}
    b, s, e, h, k, v = batch, seq, cfg.embed, cfg.heads, cfg.head_dim, cfg.vocab
    ep = _expert_devices(cfg, rules, mesh, b, s)
    m = _mlp_width(cfg, ep)
    # Grouped-query attention keeps k and v at kv_heads (the reference model's: heads).
    g = cfg.kv_heads
    qkvo = 2 * h * k + 2 * g * k
    p = np.dtype(cfg.dtype).itemsize
    # Context parallelism keeps the sequence split through the whole block (q/k/v,
    # MLP hidden, logits); elsewhere only the residual stream is (sequence parallelism
    # gathers it before attention and the MLP).
    attention = dict(rules.options).get("attention")
    seq_name = "length" if attention in ("ring", "allgather") else None
    d_b = _divisor(rules, ("batch",), (b,), mesh, 0)
    d_l = _divisor(rules, ("batch", "length", None), (b, s, e), mesh, 1)
    d_h = _divisor(rules, ("batch", seq_name, "heads", "kv"), (b, s, h, k), mesh, 1, 2)
    d_m = _divisor(rules, ("batch", seq_name, "mlp"), (b, s, cfg.mlp), mesh, 1, 2)
    d_v = _divisor(rules, ("batch", seq_name, "vocab"), (b, s, v), mesh, 1, 2)
    tokens = b * s / d_b
    # Probabilities are [queries, keys] per head (d_h counts the query split under
    # context parallelism), kept by the dense kernel alone; the memory-efficient
    # kernels and the ring keep a float32 log-sum-exp per query row and head and
    # recompute the probabilities block by block in the backward pass.
    if attention != "ring" and cfg.attention == "dense":
        probs = 4 * h * s / d_h
    else:
        # Their working set while one layer's backward pass runs (a few float32
        # [batch, heads, block, block] tiles) is a transient, like the dense kernel's
        # forward temporaries: not counted, so that the formula stays a floor.
        probs = 4 * h / d_h
    # SwiGLU keeps four mlp-wide tensors (gate, SiLU(gate), up, product), GELU two.
    mlp = (4 if cfg.family.gated_mlp else 2) * m / d_m
    qk_norm = (h * k + g * k) / d_h if cfg.family.qk_norm is not None else 0.0
    layer = p * (4 * e / d_l + qkvo / d_h + mlp + qk_norm) + probs
    edges = 2 * p * e / d_l + 8 * v / d_v
    # An expert-parallel layer's dispatch buffers live while that layer runs, the
    # logits and their gradient before the first layer's backward pass (XLA's peak is
    # in the MoE layer, with no logits): the larger of the two counts, not both.
    tail = max(edges, _dispatch_bytes(cfg, ep, p))
    if remat == "full":
        per_token = cfg.layers * p * e / d_l + layer + tail
    else:
        per_token = cfg.layers * layer + tail
    return int(tokens * per_token + _expert_weight_bytes(cfg, rules, mesh, ep, p, d_m))


def _dispatch_bytes(cfg: Any, ep: int, p: int) -> float:
    """Per local token, the dispatch and combine buffers of one expert-parallel MoE
    layer while it runs: over the dropless receive rows, ``min(ep x top_k, experts)``
    per local token (:func:`_mlp_width`), nine embedding-wide buffers, three in the
    compute dtype (the tile loops' outputs: the down projection's, and the gate and up
    projections' input gradients) and six in 32 bits (the send and combine scatters
    and the scatter-adds that transpose the dispatch's and the combine's gathers:
    XLA's CPU backend scatters a 16-bit type in 32 bits and adds in float32, and
    allocates these zero-filled buffers before the layer's loops, so they are alive
    together); and over each token's ``top_k`` slots three 32-bit ones (the gathered
    rows and their gradient). Read from the buffers alive at the compiled step's peak
    (Mixtral-8x7B and Qwen3-30B-A3B under ``fsdp_ep`` on 64 devices, bfloat16): jax
    0.10's XLA keeps 3 + 7 such buffers per receive row (34 bytes per embedding
    column), jax 0.12's 4 + 6 (32; 4 + 5, 28, for Mixtral on data=16,expert=4); 3 + 6
    (30) are counted, so that the whole formula stays under either compile (the
    planner prunes by it). Counted once per step: one layer runs at a time. 0 where
    the layer gathers instead (``ep`` = 1) or has a capacity (the reference family).

    >>> from nnx_shard.models import DecoderConfig
    >>> cfg = DecoderConfig.for_model("mixtral", embed=8, experts=4, top_k=2)
    >>> _dispatch_bytes(cfg, 4, 2) == 8 * (4 * (3 * 2 + 6 * 4) + 2 * 3 * 4)
    True
    >>> _dispatch_bytes(cfg, 1, 2)     # gathered: no receive rows
    0.0
    """
    if ep == 1 or not any(cfg.moe_layers()) or cfg.capacity_factor is not None:
        return 0.0
    rows = min(ep * cfg.top_k, cfg.experts)
    return float(cfg.embed * (rows * (3 * p + 6 * 4) + cfg.top_k * 3 * 4))


def _expert_weight_bytes(cfg: Any, rules: Any, mesh: Any, ep: int, p: int, d_m: int
                         ) -> int:
    """Bytes per device of one expert-parallel layer's local experts' weights in the
    compute dtype where the layer makes a copy of them: gathered over the axes that
    shard their ``embed`` dimension (``fsdp_ep``), or cast from another parameter
    dtype. 0 without expert parallelism, or where the layer computes with its
    parameters' own shards (``ep``)."""
    if ep == 1 or not any(cfg.moe_layers()) or cfg.capacity_factor is not None:
        return 0
    if (_divisor(rules, ("embed",), (cfg.embed,), mesh, 0) == 1
            and np.dtype(cfg.param_dtype) == np.dtype(cfg.dtype)):
        return 0
    matrices = 3 if cfg.family.gated_mlp else 2
    return int(matrices * cfg.experts // ep * cfg.embed * cfg.expert_mlp / d_m * p)
