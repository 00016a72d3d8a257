"""``load_lora``: PEFT LoRA adapter folders (``adapter_config.json`` +
``adapter_model.safetensors``) read onto a Llama-family model with
:mod:`nnx_shard._low_rank` adapters, as PEFT 0.21 reads them (written by
:mod:`nnx_shard.hf._peft_save`).

PEFT stores, per adapted ``nn.Linear`` ``M``, ``base_model.model.M.lora_A.weight``
``[r, in]`` and ``...lora_B.weight`` ``[out, r]`` (torch layout, ``W += s * B @ A``); an
adapted ``nn.Embedding`` has ``lora_embedding_A`` ``[r, vocab]`` and ``lora_embedding_B``
``[embed, r]`` (no ``.weight``); a module of ``modules_to_save`` (trained in full) is saved
under its own name, ``base_model.model.lm_head.weight``. Our kernels are ``[*in, *out]``
(heads split: q ``[embed, heads, head_dim]``, o ``[heads, head_dim, embed]``), so ``A =
lora_A.T`` reshaped to ``[*in, r]`` and ``B = lora_B.T`` reshaped to ``[r, *out]``; the
kernel of ``M`` is found with the base weights' own table (:data:`nnx_shard.hf.LLAMA_MAPPING`),
and a fused module (Phi-3's ``qkv_proj``) stands for the kernels of its rows
(:mod:`nnx_shard.hf._peft_names`). The config's fields are read by
:class:`~nnx_shard.hf._peft_config.AdapterConfig`.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from nnx_shard import _safetensors_io as st
from nnx_shard._annotate import path_str
from nnx_shard._errors import LinkedOut, NotAFile, UsageError
from nnx_shard._low_rank import Adapter, adaptable_kernels, adapters, kernel_axes, lora
from nnx_shard._trusted_files import folder_roots
from nnx_shard.hf._files import as_path
from nnx_shard.hf._lora_folder import WEIGHTS
from nnx_shard.hf._mapping import TRANSFORM_FNS, mapping_for
from nnx_shard.hf._peft_config import MERGE_FIX, AdapterConfig, fail, refused_file
from nnx_shard.hf._peft_names import (
    Part,
    full_param,
    hf_param,
    kernels,
    model_modules,
    module_parts,
)

__all__ = ["load_lora", "trained_in_full"]

PREFIX = "base_model.model."
# The factors PEFT saves; a name between (``lora_A.other.weight``) is a named adapter's.
# PEFT 0.21's from_pretrained loads the adapter it names ``default``: a plain key goes to
# that adapter's parameter (``lora_A.default.weight``), and a key already holding the name
# ``default`` goes there as it is; any other name's factors are left out.
_DEFAULT = "default"
_LINEAR = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.([\w-]+))?\.weight$")
_EMBED = re.compile(r"^base_model\.model\.(.+)\.lora_embedding_([AB])(?:\.([\w-]+))?$")
# The base layer of an adapted embedding or output layer, saved beside its factors
# (PEFT's save_embedding_layers) and loaded into the base model by from_pretrained.
_BASE = re.compile(r"^base_model\.model\.(.+)\.base_layer\.(\w+)$")


class _File(NamedTuple):
    """What an adapter's weights file holds, by module and Hugging Face tensor name."""

    factors: dict[str, dict[str, str]]  # module -> {"A": key, "B": key}
    embedding: set[str]  # the modules whose factors are lora_embedding_A / _B
    full: dict[str, str]  # tensor name -> key, for the weights PEFT writes into the model


def _scan_file(folder: Path, header: Any, cfg: AdapterConfig) -> _File:
    factors: dict[str, dict[str, str]] = {}
    twins: dict[tuple[str, str], list[str]] = {}  # (module, A/B) -> keys naming it
    embedding: set[str] = set()
    full: dict[str, str] = {}
    stray, named, flat = [], [], []
    for name, info in header.tensors.items():
        m = _LINEAR.match(name) or _EMBED.match(name)
        base = _BASE.match(name)
        if m is not None and m.group(3) not in (None, _DEFAULT):
            named.append(name)
        elif m is not None and len(info.shape) != 2:
            flat.append(f"{name} {list(info.shape)}")
        elif m is not None:
            twins.setdefault((m.group(1), m.group(2)), []).append(name)
            factors.setdefault(m.group(1), {})[m.group(2)] = name
            if m.re is _EMBED:
                embedding.add(m.group(1))
        elif base is not None:
            full[f"{base.group(1)}.{base.group(2)}"] = name
        elif name.startswith(PREFIX) and cfg.saves(name[len(PREFIX):].rpartition(".")[0]):
            full[name[len(PREFIX):]] = name
        else:
            stray.append(name)
    if stray:
        raise fail(folder, f"{WEIGHTS} holds tensors that are neither LoRA factors nor weights "
                   f"of its modules_to_save ({cfg.modules_to_save}): {', '.join(stray[:4])}",
                   "PEFT loads no such tensor: drop them from the file, or add their module "
                   "to modules_to_save in adapter_config.json if it was trained in full")
    if named:
        # PEFT would load none of these and run the base model unchanged.
        raise fail(folder, f"{WEIGHTS} holds factors of a named adapter, e.g. {named[0]}, "
                   "which PEFT's from_pretrained does not load (it reads "
                   "...lora_A.weight / ...lora_B.weight, and ...lora_A.default.weight as its "
                   "adapter 'default')", "save the adapter with PeftModel.save_pretrained, or "
                   "rename the keys to drop the adapter name")
    clash = _differing_twins(header, twins)
    if clash:
        raise fail(folder, f"{WEIGHTS} holds {clash[0]} and {clash[1]} with different values: "
                   "PEFT loads both into the one parameter of its adapter 'default' and keeps "
                   "whichever its state dict lists last, which follows the order of the file's "
                   "bytes or the keys' names as the safetensors version reads them", "keep one "
                   "of the two keys in the file (the factor the adapter was trained with)")
    if flat:
        raise fail(folder, f"{WEIGHTS} holds factors that are not matrices: "
                   f"{', '.join(flat[:4])}", "lora_A is [r, in] and lora_B [out, r]; save "
                   "the adapter again with PeftModel.save_pretrained")
    half = [m for m, ab in factors.items() if len(ab) != 2]
    if half or not (factors or full):
        raise fail(folder, f"{WEIGHTS} " + (f"lacks the lora_A or lora_B of {half[0]}" if half
                   else "holds no tensors"), "save the adapter again with "
                   "PeftModel.save_pretrained")
    return _File(factors, embedding, full)


def _differing_twins(header: Any, twins: Mapping[tuple[str, str], list[str]]
                     ) -> tuple[str, str] | None:
    """The first pair of keys naming one factor (``lora_A.weight`` and
    ``lora_A.default.weight``) whose tensors differ: equal ones give PEFT one value."""
    for keys in twins.values():
        if len(keys) < 2:
            continue
        first, other = (st.read_slice(header, k, [slice(None)] * 2) for k in keys[:2])
        if first.shape != other.shape or not np.array_equal(first, other):
            return keys[0], keys[1]
    return None


def _selected(folder: Path, cfg: AdapterConfig, model: Any, found: _File) -> list[str]:
    """The modules of the file PEFT loads: those its config targets in this model."""
    targeted = {m for m in model_modules(model) if cfg.targeted(m)}
    if not targeted:
        raise fail(folder, f"{cfg.fields()} selects no module of this model (PEFT raises "
                   "'not found in the base model')", "name projections the model has, e.g. "
                   "\"target_modules\": [\"q_proj\", \"v_proj\"] (Phi-3: \"qkv_proj\", "
                   "\"gate_up_proj\")")
    chosen = sorted(m for m in found.factors if m in targeted)
    if not chosen and found.factors:
        raise fail(folder, f"{cfg.fields()} selects none of the modules {WEIGHTS} holds "
                   f"factors of ({', '.join(sorted(found.factors)[:4])}): PEFT would load "
                   "nothing", "fix the config's target_modules to the adapted modules")
    return chosen


class _Host(NamedTuple):
    a: np.ndarray
    b: np.ndarray
    rank: int
    scale: float


def _host_factors(folder: Path, cfg: AdapterConfig, header: Any, model: Any, found: _File,
                  where: Mapping[str, list[Part]]) -> dict[str, _Host]:
    """Our kernel path -> its factors on the host in our layout (stacked: every layer's
    slot, zero where the file has none), rank and scale; every problem is found before
    the model changes."""
    shapes = kernels(model)
    nodes = adapters(model)
    plain, _ = adaptable_kernels(model)
    hosts: dict[str, _Host] = {}
    errors = []
    for module, parts in sorted(where.items()):
        r, scale = cfg.rank_scale(module)
        a_hf = st.read_slice(header, found.factors[module]["A"], [slice(None)] * 2)
        b_hf = st.read_slice(header, found.factors[module]["B"], [slice(None)] * 2)
        total = 0
        for kpath, layer, rows in parts:
            if (kpath == "token_embed") != (module in found.embedding):
                errors.append(f"{module}: " + ("an embedding needs lora_embedding_A / _B"
                              if kpath == "token_embed" else "lora_embedding_A / _B on a "
                              "projection"))
                break
            node = nodes.get(kpath)
            full = tuple(shapes[kpath].shape)
            if node is None and kpath not in plain:
                errors.append(f"{kpath} cannot take an adapter (it is trained in full)")
                break
            n_in = node.n_in if node is not None else kernel_axes(
                kpath, plain[kpath][2], plain[kpath][0])[1]
            shape = full[1:] if layer is not None else full
            ins, outs = shape[:n_in], shape[n_in:]
            total += math.prod(outs)
            b_part = b_hf[rows]
            want = ((r, math.prod(ins)), (math.prod(outs), r))
            if (a_hf.shape, b_part.shape) != want:
                qa = bool(cfg.raw.get("use_qalora")) and a_hf.shape[1] != want[0][1]
                pooled = (" (use_qalora: trained on GPTQ layers, whose QA-LoRA pools the "
                          "inputs; PEFT runs plain LoRA on any other layer)") if qa else ""
                errors.append(f"{module}: lora_A {a_hf.shape} / lora_B {b_hf.shape}, this "
                              f"model needs {want[0]} / {want[1]} (rank {r}){pooled}")
                break
            if node is not None and node.rank != r:
                errors.append(f"{kpath} has an adapter of rank {node.rank}, the file's is {r}")
                break
            a = np.ascontiguousarray(a_hf.T).reshape(*ins, r)
            b = np.ascontiguousarray(b_part.T).reshape(r, *outs)
            if layer is None:
                hosts[kpath] = _Host(a, b, r, scale)
                continue
            have = hosts.get(kpath)
            if have is None:
                have = hosts[kpath] = _Host(np.zeros((full[0], *ins, r), a.dtype),
                                            np.zeros((full[0], r, *outs), b.dtype), r, scale)
            if have.rank != r:
                errors.append(f"{kpath}: the layers of this stacked kernel have ranks "
                              f"{have.rank} and {r} (rank_pattern); one stacked adapter has "
                              "one rank: build the model with scan_layers=False")
                break
            # One stacked adapter has one scale: a layer's own goes into its B.
            have.a[layer], have.b[layer] = a, b * (scale / have.scale)
        else:
            if len(parts) > 1 and total != b_hf.shape[0]:
                errors.append(f"{module}: lora_B has {b_hf.shape[0]} rows, the fused "
                              f"kernels {total}")
    if errors:
        raise fail(folder, "its factors do not fit this model: " + "; ".join(errors[:6]),
                   "load it onto the model it was trained for (its base_model_name_or_path), "
                   "built from that checkpoint's config.json")
    return hosts


def _full_values(folder: Path, cfg: AdapterConfig, header: Any, model: Any, found: _File
                 ) -> tuple[dict[str, np.ndarray], set[str]]:
    """Model path -> its new value on the host (the weights PEFT writes into the model:
    modules_to_save, base layers saved beside an embedding's factors), and the paths
    trained in full (every parameter of a module of modules_to_save)."""
    params = kernels(model)
    tied = getattr(model, "unembed", "absent") is None
    trained = set()
    for path, var in params.items():
        names = hf_param(model, path, var)
        if names and any(cfg.saves(n.rpartition(".")[0]) for n, _ in names):
            trained.add(path)
    if tied and "token_embed" in trained:
        raise fail(folder, f"modules_to_save={cfg.modules_to_save} trains the embedding of a "
                   "model with tied embeddings in full: PEFT then keeps a trained copy for "
                   "the input and the untrained one for the output, which one tied table "
                   "cannot hold", MERGE_FIX)
    values: dict[str, np.ndarray] = {}
    errors = []
    for name, key in sorted(found.full.items()):
        target = full_param(model, name)
        if target is None or target[0] not in params:
            errors.append(f"{name} is no parameter of this model")
            continue
        path, layer, transform = target
        var = params[path]
        shape = tuple(var.shape)[1:] if layer is not None else tuple(var.shape)
        info = header.tensors[key]
        want = TRANSFORM_FNS[transform].hf_shape(shape)
        if tuple(info.shape) != tuple(want):
            errors.append(f"{name} is {list(info.shape)}, this model needs {list(want)}")
            continue
        x = TRANSFORM_FNS[transform].to_model(
            st.read_slice(header, key, [slice(None)] * len(info.shape)), shape)  # type: ignore[arg-type]
        if layer is None:
            values[path] = np.asarray(x)
        else:
            values.setdefault(path, host_copy(var.get_value()))[layer] = x
    if errors:
        raise fail(folder, "its full weights do not fit this model: " + "; ".join(errors[:6]),
                   "load it onto the model it was trained for (its base_model_name_or_path)")
    return values, trained


def _retype(model: Any, paths: set[str]) -> None:
    """Makes the parameters ``paths`` ``nnx.LoRAParam``: trained with the adapters."""
    owners = {path_str(p): (p, n) for p, n in nnx.iter_graph(model)}
    for path in sorted(paths):
        keys, var = owners[path]
        if isinstance(var, nnx.LoRAParam):
            continue
        owner = owners["/".join(str(k) for k in keys[:-1])][1] if len(keys) > 1 else model
        new = nnx.LoRAParam(var.get_value(), **var.get_metadata())
        if isinstance(owner, nnx.Module) and isinstance(keys[-1], str):
            setattr(owner, keys[-1], new)
        else:
            owner[keys[-1]] = new


def trained_in_full(model: Any) -> dict[str, nnx.LoRAParam[Any]]:
    """The parameters of ``model`` trained in full beside its adapters (PEFT's
    ``modules_to_save``: ``nnx.LoRAParam`` outside any adapter), by path.

    >>> from nnx_shard.models import Decoder, get_config
    >>> trained_in_full(Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0)))
    {}
    """
    sites = {path_str(p) for p, n in nnx.iter_graph(model) if isinstance(n, Adapter)}
    return {path_str(p): n for p, n in nnx.iter_graph(model)
            if isinstance(n, nnx.LoRAParam)
            and not any(path_str(p).startswith(f"{s}/") for s in sites)}


def load_lora(path: str | os.PathLike[str], model: Any, *, rngs: int = 0) -> Any:
    """Reads the PEFT LoRA adapter folder ``path`` onto the Llama-family ``model``
    (concrete, any sharding, stacked blocks too) and returns ``model``, computing what
    ``PeftModel.from_pretrained(base, path)`` computes.

    The model gets adapters on the modules PEFT adapts (through :func:`nnx_shard.lora`
    when it has none there yet; existing ones must have the file's rank): the
    projections (Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` as their q, k, v / gate,
    up kernels, each with the rows of ``lora_B`` it owns and one ``lora_A`` variable for
    all, so a training step moves it by their summed gradients as PEFT's does, and one
    dropout mask for all, as PEFT drops the fused module's input once),
    ``lm_head`` and ``embed_tokens`` (``lora_embedding_A`` / ``_B``, applied to the
    looked-up rows). Each is scaled ``lora_alpha / r`` (``/ sqrt(r)`` with
    ``use_rslora``; ``rank_pattern`` / ``alpha_pattern`` per module, matched as PEFT
    matches them; ``lora_alpha`` is 8 when the config has none, as in PEFT) and keeps
    the config's ``lora_dropout`` (active while training, off in ``model.eval()`` and
    generation; the embedding's has none, as in PEFT; stacked blocks take none, with
    a warning). The weights of ``modules_to_save`` are written into the model and
    their parameters become ``nnx.LoRAParam``, so an optimizer ``wrt=nnx.LoRAParam``
    trains them with the adapters (:func:`trained_in_full` lists them). As PEFT's
    ``from_pretrained``, it loads only the factors of the modules the config
    selects: ``target_modules`` (a list of names or ``.``-suffixes, a regex over the
    whole name, or ``"all-linear"``), within ``layers_to_transform`` (and
    ``layers_pattern``), less ``exclude_modules``. The config's regexes match as
    PEFT's ``re`` matches them, within one time bound for the load (a pattern that
    backtracks without end is refused naming it, not run for hours); one PEFT could
    not compile is refused naming it. Every other config field is ignored where it
    changes nothing PEFT computes, or refused naming it
    (:data:`nnx_shard.hf._peft_config.FIELDS`). Factors are read under their plain
    keys and under the adapter name ``default`` (``lora_A.default.weight``), as PEFT
    reads both into its adapter ``default``; one factor under both keys with
    different values, factors of another adapter name and of modules the model lacks
    are refused. Each device takes its slice of the factors in the adapter's sharding.

    Args:
      path: the adapter folder (``adapter_config.json`` and
        ``adapter_model.safetensors``), as ``PeftModel.save_pretrained`` writes it.
      model: a Llama-family model holding values (not abstract), any sharding; changed
        in place.
      rngs: the seed of the adapters :func:`nnx_shard.lora` adds (their dropout masks;
        the factors are then overwritten by the file's).

    Returns:
      ``model``, with the adapter's factors (and ``modules_to_save`` weights) loaded.

    Raises:
      UsageError: a config field refused, malformed or unreadable, or factors that do
        not fit the model (the module and the fix named).

    >>> import tempfile
    >>> from flax import nnx
    >>> from nnx_shard import lora
    >>> from nnx_shard.hf import load_lora, save_lora
    >>> from nnx_shard.models import Decoder, get_config
    >>> model = Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))
    >>> _ = lora(model, 4, 8.0, targets=r"attn/(q|v)$")
    >>> folder = tempfile.mkdtemp()
    >>> save_lora(folder, model)
    >>> other = load_lora(folder, Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0)))
    >>> import jax
    >>> jax.tree.structure(nnx.state(other, nnx.LoRAParam)) == jax.tree.structure(
    ...     nnx.state(model, nnx.LoRAParam))
    True
    """
    folder = as_path(path, "load_lora")
    cfg = AdapterConfig.read(folder)
    _check_concrete(model, "load_lora")
    file = folder / WEIGHTS
    if not file.is_file():
        found_files = ", ".join(sorted(p.name for p in folder.iterdir())[:8])
        raise fail(folder, f"has no {WEIGHTS} (found: {found_files or 'nothing'})",
                   "save the adapter with safe_serialization=True (PEFT's default)")
    with contextlib.ExitStack() as stack:
        # The weights file opened once, inside the folder: its header and every factor
        # come from that one descriptor (a file swapped for a link out is refused).
        roots = folder_roots(folder)  # before the open: a refusal names the folder checked
        try:
            header = stack.enter_context(st.opened([str(file)], roots))
        except (LinkedOut, NotAFile) as e:
            raise refused_file(folder, WEIGHTS, e, roots) from None
        found = _scan_file(folder, header, cfg)
        mapping_for(model)  # a model with no Hugging Face names fails here, with its fix
        where, bad = module_parts(model, sorted(found.factors))
        if bad:
            raise fail(folder, f"adapts modules that are not projections, lm_head or "
                       f"embed_tokens of this model: {', '.join(bad[:6])}", "load it onto the "
                       "model it was trained for (its base_model_name_or_path; Phi-3 names "
                       "qkv_proj and gate_up_proj, not q/k/v_proj or gate/up_proj)")
        where = {m: where[m] for m in _selected(folder, cfg, model, found)}
        hosts = _host_factors(folder, cfg, header, model, found, where)
        values, trained = _full_values(folder, cfg, header, model, found)
    stacked = {k for k in hosts if scanned(model) and k.startswith("blocks/")}
    if cfg.dropout and stacked:
        warnings.warn(f"load_lora: {folder}: lora_dropout={cfg.dropout} is not applied to the "
                      f"stacked (scanned) blocks ({sorted(stacked)[0]!r}: a scan would draw "
                      "one mask for every layer); build the model with scan_layers=False to "
                      "train with it", stacklevel=2)
    nodes = adapters(model)
    seeds = nnx.Rngs(rngs)  # one stream for every adapter: each forks its own mask stream
    groups: dict[tuple[int, float, float], list[str]] = {}
    for kpath, h in hosts.items():
        p = 0.0 if kpath == "token_embed" or kpath in stacked else cfg.dropout
        if kpath not in nodes:
            groups.setdefault((h.rank, h.scale, p), []).append(kpath)
        else:
            nodes[kpath].dropout = nnx.data(nnx.Dropout(p, rngs=seeds) if p else None)
    for (r, scale, p), paths in sorted(groups.items()):
        targets = "^(" + "|".join(re.escape(k) for k in paths) + ")$"
        lora(model, r, scale * r, targets=targets, rngs=seeds, dropout=p)
    nodes = adapters(model)
    for kpath, h in hosts.items():
        node = nodes[kpath]
        node.lora_a.set_value(_put(h.a, node.lora_a.get_value()))
        node.lora_b.set_value(_put(h.b, node.lora_b.get_value()))
        node.scale = h.scale
    _share_fused(nodes, hosts, where)
    params = kernels(model)
    for kpath, value in values.items():
        params[kpath].set_value(_put(value, params[kpath].get_value()))
    _retype(model, trained)
    return model


def _share_fused(nodes: Mapping[str, Adapter], hosts: Mapping[str, _Host],
                 where: Mapping[str, list[Part]]) -> None:
    """The parts of a fused module (Phi-3's q, k, v of ``qkv_proj``) hold one ``lora_A``
    variable, as PEFT's one factor: a gradient step then moves it by the sum of the parts'
    gradients, not each copy by its own. Their dropouts are copies of one (same key, same
    count, each its own variables): the block calls every part once per forward on the
    same input, so the copies draw one mask, as PEFT drops the fused module's input once."""
    groups = {tuple(sorted({kpath for kpath, _, _ in parts}))
              for parts in where.values() if len(parts) > 1}
    for group in groups:
        drop = nodes[group[0]].dropout
        if drop is not None:
            for kpath in group[1:]:
                nodes[kpath].dropout = nnx.data(nnx.clone(drop))
        first = hosts[group[0]]
        if all(np.array_equal(hosts[k].a, first.a) for k in group[1:]):
            for kpath in group[1:]:
                nodes[kpath].lora_a = nodes[group[0]].lora_a


def _check_concrete(model: Any, who: str) -> None:
    """Refuses a model without values (nnx.eval_shape, ns.abstract_init) or with deleted
    (donated) arrays before it is changed: its adapters could never be computed."""
    if not isinstance(model, nnx.Module):
        return  # mapping_for names what is wrong with it
    for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if isinstance(value, jax.Array) and not value.is_deleted():
            continue
        what = ("a deleted array (donated to a step)" if isinstance(value, jax.Array) else
                f"abstract ({type(value).__name__}: a shape and dtype, no values)")
        raise UsageError(f"{who}: model parameter {path_str(key)!r} is {what}. Nothing was "
                         "changed. Fix: pass a model with values: load the base weights first "
                         "(ns.hf.load_pretrained, or ns.hf.load_safetensors into an abstract_init "
                         "model)")


def _put(host: np.ndarray, like: Any) -> jax.Array:
    sharding = getattr(like, "sharding", None)
    host = host.astype(like.dtype)
    if isinstance(sharding, NamedSharding):
        # Each device takes its own slice of the (small) host copy.
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
    return jax.numpy.asarray(host)


def host_copy(x: Any) -> np.ndarray:
    """``x`` whole on this host, as numpy (an array spread over processes gathered first)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def scanned(model: Any) -> bool:
    """Whether ``model``'s blocks are one stacked (scanned) module: a leading layers axis."""
    return bool(getattr(getattr(model, "cfg", None), "scan_layers", False))
