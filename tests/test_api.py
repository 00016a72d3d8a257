import nnx_shard as ns

EXPECTED = {
    "Fallbacks", "NnxShardError", "Report", "Rules", "ShardingError", "ShardingWarning", "annotate", "constrain", "explain",
    "get_logical_axes", "logical_axes", "make_mesh", "shardings", "use", "with_logical",
    "abstract_init", "sharded_init", "sharded_optimizer",
    "Trainer", "Precision", "mean_over", "multistep", "shard_batch", "value_and_grad", "MetricsWriter", "Batches",
    "pack",
    "Checkpointer", "restore", "save", "load_safetensors", "save_safetensors",
    "lora", "merge_lora", "load_lora", "save_lora", "QuantizedKernel",
    "distributed", "models", "pipeline", "strategies", "collective_matmul", "hf", "tp_layers",
}


def test_public_surface_is_pinned():
    assert set(ns.__all__) == EXPECTED
    public = {n for n in dir(ns) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(ns, n)).__name__ == "module"}
    assert public - modules == EXPECTED - modules


def test_every_public_function_has_an_example():
    for name in ns.__all__:
        doc = getattr(ns, name).__doc__ or ""
        assert doc.strip(), name
        if callable(getattr(ns, name)) and name not in {"ShardingError", "ShardingWarning", "Report"}:
            assert ">>>" in doc, f"{name} has no example"


def test_sharding_error_is_value_error():
    assert issubclass(ns.ShardingError, ValueError)


def test_every_deliberate_error_is_one_family():
    from nnx_shard.distributed import DistributedError
    from nnx_shard.errors import CompileError, UsageError

    for error in (ns.ShardingError, UsageError, CompileError, DistributedError):
        assert issubclass(error, ns.NnxShardError), error
    assert issubclass(UsageError, ValueError) and issubclass(CompileError, RuntimeError)
    assert issubclass(DistributedError, RuntimeError)


MODELS = {
    "CACHE_AXES", "CONFIGS", "LLAMA_CONFIGS", "REMAT_POLICIES", "Llama", "LlamaConfig",
    "Tokenizer", "Transformer", "TransformerConfig", "attention", "attention_fn", "explain_cache",
    "generate", "generate_text", "generation_rules", "get_config", "get_llama_config", "lm_loss",
    "remat_policy", "resize_token_embeddings", "stream", "stream_text",
}


def test_models_surface_is_pinned():
    assert set(ns.models.__all__) == MODELS
    assert all(hasattr(ns.models, n) for n in MODELS)
    for name in ("generate", "explain_cache", "generation_rules", "stream", "Tokenizer",
                 "generate_text", "stream_text", "resize_token_embeddings"):
        assert ">>>" in (getattr(ns.models, name).__doc__ or ""), f"{name} has no example"
    assert ns.models.CACHE_AXES == ("cache_batch", "cache_length", "cache_kv_heads",
                                    "cache_head_dim")
