"""Hugging Face safetensors checkpoints, loaded straight into a sharded layout and
saved back from any mesh.

Which to call:

* :func:`load_pretrained` ``(folder, mesh=, rules=)``: a checkpoint of a family nnx_shard
  knows (its ``config.json`` says which: Llama, Qwen2/3, Mistral, Gemma 1/2/3, OLMo 2,
  Phi-3). It reads the config, builds the :class:`~nnx_shard.models.Decoder` abstractly
  and fills it: one call from a folder to a sharded model;
* :func:`load_safetensors` ``(folder, model)``: a model you built yourself (any
  module, abstract from ``ns.abstract_init``), filled through a mapping table
  (:data:`LLAMA_MAPPING`, :func:`mapping_for`, or your own) — what
  :func:`load_pretrained` calls underneath;
* :func:`save_safetensors` ``(folder, model)``: the way back, from any mesh;
* :func:`load_lora` / :func:`save_lora`: PEFT adapter folders onto and from a model
  adapted with :func:`nnx_shard.lora`;
* :func:`tiny_checkpoint` ``(folder, family)``: a tiny checkpoint of random weights with a
  tokenizer, written without torch or a download: something to try the others on.

:func:`load_safetensors` fills an abstract model (``ns.abstract_init``: shapes and shardings, nothing allocated) from a
checkpoint directory, one model parameter at a time:

1. every Hugging Face tensor is matched to a parameter by a mapping table
   (:data:`LLAMA_MAPPING`: regular expressions on the Hugging Face name ->
   parameter path and transform, the style of :func:`nnx_shard._annotate`);
   every problem (missing, unused, mis-shaped or mis-typed tensors) is
   collected into one error;
2. the tensor is read in the Hugging Face layout with a sharding derived from
   the parameter's own (``jax.make_array_from_callback``): each process reads,
   with ranged reads (:mod:`nnx_shard._safetensors_io`), only the slices its
   devices hold; a parameter stacked over layers (``scan_layers``) is read as
   one ``[layers, ...]`` array whose layer dimension is split like the
   parameter's (pipeline stages read only their own layers);
3. one compiled call per parameter turns it into the model's layout
   (transpose to ``[in, out]``, split heads, cast dtype; vmapped over stacked
   layers) with the parameter's sharding as output sharding. The derived input
   sharding makes that call local: it contains no collective (the tests read
   its HLO), and the Hugging Face-layout copy is freed before the next
   parameter is read. A process thus holds its devices' shards of the model
   plus those of one parameter in flight (for a stacked parameter, all its
   layers). Calls with equal shapes and shardings reuse one compilation.

:func:`save_safetensors` runs the same transforms backwards, one parameter at a
time, and every process writes the shards it owns straight into their byte
ranges of the output files (the files are created, at their final size, by
process 0): nothing is gathered to one host. Processes must share the
filesystem. The files are written in a staging folder beside the destination
and swapped into place whole (:mod:`nnx_shard.hf._export_dir`): a failed or
killed save leaves the previous export. A model of
:func:`load_pretrained` remembers its checkpoint (:mod:`nnx_shard.hf._source`),
and its export carries the checkpoint's config, generation config and
tokenizer files, in its dtype: a folder to publish.

Transforms (the second element of a mapping value): ``"copy"``,
``"transpose"`` (``[out, in] -> [in, out]``), ``"heads_out"`` (``[heads *
head_dim, embed] -> [embed, heads, head_dim]``: q/k/v), ``"heads_in"``
(``[embed, heads * head_dim] -> [heads, head_dim, embed]``: o) and
``"heads_bias"`` (``[heads * head_dim] -> [heads, head_dim]``).

>>> import tempfile
>>> from flax import nnx
>>> import nnx_shard as ns
>>> from nnx_shard.hf import load_safetensors, save_safetensors
>>> from nnx_shard.models import Decoder, get_config
>>> factory = lambda: Decoder(get_config("llama-tiny"), rngs=nnx.Rngs(0))
>>> fsdp = ns.strategies.get("fsdp")
>>> model = ns.sharded_init(factory, "data=8", fsdp)
>>> out = tempfile.mkdtemp()
>>> save_safetensors(out, model)
>>> loaded = load_safetensors(out, ns.abstract_init(factory, "data=2,model=4", ns.strategies.get("tp")))
>>> loaded.blocks[0].attn.q.get_value().sharding.spec
P(None, 'model', None)
>>> bool((loaded.blocks[0].attn.q.get_value() == model.blocks[0].attn.q.get_value()).all())
True
"""

from nnx_shard.hf._load import load_safetensors
from nnx_shard.hf._mapping import LLAMA_MAPPING, mapping_for
from nnx_shard.hf._peft import load_lora
from nnx_shard.hf._peft_save import save_lora
from nnx_shard.hf._pretrained import load_pretrained
from nnx_shard.hf._save import save_safetensors
from nnx_shard.hf._source import Source, source_of
from nnx_shard.hf._tiny import tiny_checkpoint

__all__ = ["LLAMA_MAPPING", "Source", "load_lora", "load_pretrained", "load_safetensors",
           "mapping_for", "save_lora", "save_safetensors", "source_of", "tiny_checkpoint"]
