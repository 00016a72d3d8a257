"""The public surface, pinned: every public module's ``__all__`` (a module whose dotted
path has no part starting with ``_``), at most 150 names in all, each documented."""

import ast
import importlib
import pathlib

import nnx_shard as ns

PACKAGE = pathlib.Path(ns.__file__).resolve().parent

EXPECTED = {
    "Fallbacks", "NnxShardError", "UsageError", "CompileError", "Report", "Rules",
    "ShardingError", "ShardingWarning", "annotate", "constrain", "explain", "get_logical_axes",
    "logical_axes", "make_mesh", "shardings", "use", "with_logical",
    "abstract_init", "sharded_init", "sharded_optimizer",
    "Trainer", "DiLoCo", "Precision", "mean_over", "multistep", "shard_batch", "value_and_grad",
    "apply_gradients",
    "MetricsWriter", "Batches", "pack",
    "Checkpointer", "restore", "save",
    "lora", "merge_lora", "QuantizedKernel",
    "distributed", "hf", "inference", "models", "pipeline", "planner", "preference",
    "strategies",
    "collective_matmul", "tp_layers", "corpus",
}

#: Each public module other than the package itself, with its ``__all__``.
MODULES = {
    "nnx_shard.models": {"CONFIGS", "Decoder", "DecoderConfig", "Qwen3MoeConfig", "REMAT_POLICIES",
                         "ReferenceConfig", "attention", "attention_fn", "get_config",
                         "lm_loss", "remat_policy", "resize_token_embeddings"},
    "nnx_shard.inference": {"CACHE_AXES", "GenerationConfig", "Tokenizer", "explain_cache",
                            "generate", "generate_text", "generation_rules", "stream",
                            "stream_text"},
    "nnx_shard.hf": {"LLAMA_MAPPING", "Source", "load_lora", "load_pretrained", "load_safetensors",
                     "mapping_for", "save_lora", "save_safetensors", "source_of",
                     "tiny_checkpoint"},
    "nnx_shard.strategies": {"LOGICAL", "NAMES", "Strategy", "get", "preset"},
    "nnx_shard.planner": {"AutoOptions", "Candidate", "Collective", "Hardware", "MemorySplit",
                          "NothingFits", "Plan", "UserModel", "auto", "compiled_collectives",
                          "compiled_memory", "hardware", "memory_split", "partitioned_hlo"},
    "nnx_shard.pipeline": {"Schedule", "StageReport", "bubble", "idle_fraction", "run", "scan",
                           "schedule_table", "stack", "stage_count", "stage_report", "unstack"},
    "nnx_shard.distributed": {"Coordinates", "DistributedError", "gather", "initialize",
                              "is_main", "local_part", "process_slice"},
    "nnx_shard.collective_matmul": {"all_gather_matmul", "matmul_reduce_scatter"},
    "nnx_shard.tp_layers": {"ProjectionOp", "intercept"},
    "nnx_shard.preference": {"KINDS", "WithReference", "dpo", "example_pairs", "loss", "orpo",
                             "reference_logps", "simpo", "tokenize"},
    "nnx_shard.cli": {"main"},
    "nnx_shard.corpus": {"VOCAB", "CharCorpus", "decode", "encode", "load_stdlib"},
}


def public_modules() -> list[str]:
    """Every module of the package whose dotted path has no part starting with ``_``."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            out.append(".".join(parts))
    return out


def test_public_surface_is_pinned():
    assert set(ns.__all__) == EXPECTED
    public = {n for n in dir(ns) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(ns, n)).__name__ == "module"}
    assert public - modules == EXPECTED - modules


def test_every_public_module_is_pinned_and_the_surface_is_small():
    assert set(public_modules()) == {"nnx_shard", *MODULES}
    for name, names in MODULES.items():
        module = importlib.import_module(name)
        assert set(module.__all__) == names, name
        assert all(hasattr(module, n) for n in names), name
    total = len(ns.__all__) + sum(len(v) for v in MODULES.values())
    assert total <= 150, total


def test_every_public_module_defines_all():
    for name in public_modules():
        tree = ast.parse(pathlib.Path(importlib.import_module(name).__file__).read_text())
        assert any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                     for t in n.targets) for n in tree.body), name


def test_every_public_function_has_an_example():
    for name in ns.__all__:
        doc = getattr(ns, name).__doc__ or ""
        assert doc.strip(), name
        if callable(getattr(ns, name)) and name not in {"ShardingError", "ShardingWarning",
                                                        "Report", "UsageError", "CompileError"}:
            assert ">>>" in doc, f"{name} has no example"
    for module, names in MODULES.items():
        mod = importlib.import_module(module)
        for name in names:
            obj = getattr(mod, name)
            if callable(obj) and not isinstance(obj, type):
                assert ">>>" in (obj.__doc__ or ""), f"{module}.{name} has no example"


def test_sharding_error_is_value_error():
    assert issubclass(ns.ShardingError, ValueError)


def test_every_deliberate_error_is_one_family():
    from nnx_shard.distributed import DistributedError

    for error in (ns.ShardingError, ns.UsageError, ns.CompileError, DistributedError):
        assert issubclass(error, ns.NnxShardError), error
    assert issubclass(ns.UsageError, ValueError) and issubclass(ns.CompileError, RuntimeError)
    assert issubclass(DistributedError, RuntimeError)



def test_cache_axes_are_named():
    assert ns.inference.CACHE_AXES == ("cache_batch", "cache_length", "cache_kv_heads",
                                       "cache_head_dim")
