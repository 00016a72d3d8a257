"""Hostile cases of PEFT adapter folders: ``ns.hf.load_lora`` of folders whose config
selects nothing, sets a LoRA variant's field or malformed selection fields, or whose
factors are not matrices or belong to a named adapter, and onto a model without
values; ``ns.hf.save_lora`` to a dangling link, under a file, over a folder where a file
goes, of a model without values, and onto a full disk (simulated).

Folders are copies of ``tests/fixtures/peft_cases/full`` (factors of all fourteen
projections of the two-layer fixture) with the config or the tensors changed.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from typing import Any

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
FULL = os.path.join(FIXTURES, "peft_cases", "full")


def build(hs: Any) -> None:
    F = hs.F

    def ns() -> Any:
        import nnx_shard

        return nnx_shard

    def folder(name: str, change: dict[str, Any] | None = None,
               tensors: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> str:
        return hs.peft_copy(FULL, F.path(f"lora_files_{name}"), change, tensors)

    def load(path: str, model: Any = None) -> Any:
        return ns().hf.load_lora(path, hs._tiny_llama() if model is None else model)

    # load_lora: the config's selection and variant fields ---------------------------------------
    hs.api("lora_files/load_target_nothing", ("target_modules", "nothing_proj"),
           lambda: load(folder("nothing", {"target_modules": ["nothing_proj"]})))
    hs.api("lora_files/load_target_regex_nothing", "target_modules",
           lambda: load(folder("rx_nothing", {"target_modules": r".*\.lm_head_proj"})))
    hs.api("lora_files/load_target_null", "target_modules",
           lambda: load(folder("tnull", {"target_modules": None})))
    hs.api("lora_files/load_target_empty", "target_modules",
           lambda: load(folder("tempty", {"target_modules": []})))
    hs.api("lora_files/load_target_int", "target_modules",
           lambda: load(folder("tint", {"target_modules": 5})))
    hs.api("lora_files/load_target_bad_regex", "target_modules",
           lambda: load(folder("trx", {"target_modules": "q_proj(["})))
    hs.api("lora_files/load_target_no_factor", ("target_modules", "lm_head"),
           lambda: load(folder("tnofactor", {"target_modules": ["lm_head"]})))
    hs.api("lora_files/load_all_excluded", ("exclude_modules", "target_modules"),
           lambda: load(folder("allex", {"exclude_modules": ".*"})))
    hs.api("lora_files/load_exclude_int", "exclude_modules",
           lambda: load(folder("exint", {"exclude_modules": 3})))
    hs.api("lora_files/load_exclude_bad_regex", "exclude_modules",
           lambda: load(folder("exrx", {"exclude_modules": "(("})))
    hs.api("lora_files/load_layers_str", "layers_to_transform",
           lambda: load(folder("lstr", {"layers_to_transform": "0"})))
    hs.api("lora_files/load_layers_bool", "layers_to_transform",
           lambda: load(folder("lbool", {"layers_to_transform": [True]})))
    hs.api("lora_files/load_layers_out_of_range", ("target_modules", "layers_to_transform"),
           lambda: load(folder("lrange", {"layers_to_transform": [5]})))
    hs.api("lora_files/load_layers_with_regex_targets", "layers_to_transform",
           lambda: load(folder("lregex", {"target_modules": ".*q_proj",
                                          "layers_to_transform": [0]})))
    hs.api("lora_files/load_pattern_without_layers", "layers_pattern",
           lambda: load(folder("pnolayers", {"layers_pattern": "layers"})))
    hs.api("lora_files/load_pattern_int", "layers_pattern",
           lambda: load(folder("pint", {"layers_pattern": 4, "layers_to_transform": 0})))
    for field, value in [("alora_invocation_tokens", [1, 2, 3]),
                         ("layer_replication", [[0, 2], [1, 2]]),
                         ("target_parameters", ["mlp.experts.gate_up_proj"]),
                         ("trainable_token_indices", [0, 1]),
                         ("use_bdlora", {"target_modules_bd_a": ["q_proj"]}),
                         ("arrow_config", {"top_k": 2}), ("lora_bias", True),
                         ("init_lora_weights", "pissa"), ("init_lora_weights", "OLoRA"),
                         ("init_lora_weights", "pissa_niter_4")]:
        label = f"{field}_{value.lower()}" if field == "init_lora_weights" else field
        hs.api(f"lora_files/load_{label}", field,
               lambda f=field, v=value, n=label: load(folder(n, {f: v})))
    hs.api("lora_files/load_alpha_none", "lora_alpha",
           lambda: load(folder("anone", {"lora_alpha": None})))

    # load_lora: the factors ----------------------------------------------------------------------
    def reshaped(ndim: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
        def change(old: dict[str, Any]) -> dict[str, Any]:
            key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
            v = old[key]
            old[key] = v.reshape(-1) if ndim == 1 else v.reshape(1, *v.shape)
            return old

        return change

    hs.api("lora_files/load_factor_1d", ("q_proj.lora_A", "matrices"),
           lambda: load(folder("f1d", tensors=reshaped(1))))
    hs.api("lora_files/load_factor_3d", ("q_proj.lora_A", "matrices"),
           lambda: load(folder("f3d", tensors=reshaped(3))))
    hs.api("lora_files/load_named_adapter", ("lora_A.other.weight", "named adapter"),
           lambda: load(folder("named", tensors=lambda old: {
               k.replace(".lora_A.", ".lora_A.other.").replace(".lora_B.", ".lora_B.other."): v
               for k, v in old.items()})))
    # Factors under the name "default" alone load (PEFT 0.21 reads them into its adapter
    # "default"); beside plain ones of other values, PEFT's pick depends on the file's order.
    hs.api("lora_files/load_default_adapter_twice", ("lora_A.default.weight", "different values"),
           lambda: load(folder("named_default", tensors=lambda old: old | {
               k.replace(".lora_A.", ".lora_A.default."): v + 1.0
               for k, v in old.items() if ".lora_A." in k})))
    hs.api("lora_files/load_scalar_factor", ("lora_B", "matrices"),
           lambda: load(folder("scalar", tensors=lambda old: old | {
               "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight":
                   __import__("numpy").float32(1.0).reshape(())})))

    def abstract() -> Any:
        from flax import nnx

        return load(folder("abstract_ok"), nnx.eval_shape(hs._tiny_llama))

    hs.api("lora_files/load_onto_abstract_model", ("abstract", "model"), abstract)

    def donated() -> Any:
        model = hs._tiny_llama()
        model.blocks[0].attn.q.get_value().delete()
        return load(folder("donated_ok"), model)

    hs.api("lora_files/load_onto_deleted_arrays", ("deleted", "model"), donated)

    # save_lora -------------------------------------------------------------------------------------
    def adapted() -> Any:
        return ns().lora(hs._tiny_llama(), 2, 4.0)

    def dangling() -> Any:
        link = F.path("lora_files_dangling")
        if not os.path.lexists(link):
            os.symlink(F.path("lora_files_nowhere"), link)
        return ns().hf.save_lora(link, adapted())

    hs.api("lora_files/save_dangling_link", ("lora_files_dangling", "symbolic link"), dangling)
    hs.api("lora_files/save_under_file", ("lora_files_plain.txt", "not a directory"),
           lambda: ns().hf.save_lora(os.path.join(F.file("lora_files_plain.txt", "x"), "adapter"),
                                  adapted()))

    def config_is_folder() -> Any:
        out = F.dir("lora_files_cfgdir")
        os.makedirs(os.path.join(out, "adapter_config.json"), exist_ok=True)
        return ns().hf.save_lora(out, adapted())

    hs.api("lora_files/save_config_is_folder", "adapter_config.json", config_is_folder)

    def save_abstract() -> Any:
        from flax import nnx

        return ns().hf.save_lora(F.path("lora_files_abs"), nnx.eval_shape(adapted))

    hs.api("lora_files/save_abstract_model", ("abstract", "model"), save_abstract)

    @contextlib.contextmanager
    def failing(module: Any, name: str, code: int) -> Iterator[None]:
        real = getattr(module, name)

        def fail(*args: Any, **kwargs: Any) -> Any:
            raise OSError(code, os.strerror(code))

        setattr(module, name, fail)
        try:
            yield
        finally:
            setattr(module, name, real)

    def full_disk(name: str, where: str, code: int) -> Any:
        from nnx_shard.hf import _lora_folder as peft

        out = F.path(name)
        model = adapted()
        if where == "swap":  # a previous adapter there: the new one is exchanged with it
            ns().hf.save_lora(out, model)
        target = {"weights": (peft.st, "write_slice"), "config": (peft.st, "write_file"),
                  "swap": (peft.export_dir, "_exchange")}[where]
        with failing(*target, code):
            ns().hf.save_lora(out, model)
        return None

    for where, code in [("weights", errno.ENOSPC), ("config", errno.ENOSPC),
                        ("swap", errno.ENOSPC), ("config", errno.EDQUOT),
                        ("weights", errno.EROFS)]:
        name = f"lora_files_{errno.errorcode[code].lower()}_{where}"
        hs.api(f"lora_files/save_{errno.errorcode[code].lower()}_{where}", (name, "Fix"),
               lambda n=name, w=where, c=code: full_disk(n, w, c))

