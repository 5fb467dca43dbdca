"""The ``llama`` family (Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM): its torch half.

    model.py            Transformer and its blocks, built from LlamaArgs
    tensor_parallel.py  the tensor-parallel plan
    family.py           LlamaFamily: build, TP plan, init rules, Hugging Face names (registered as ``llama``)

The torch-free half (LlamaArgs: fields, counts, validation; the config.json reader and writer)
is ``workers.spec.families.llama`` and ``llama_hf``, which the planner and the driver read.
"""

from workers.models.llama.family import LlamaFamily
from workers.models.llama.model import Transformer

__all__ = ["LlamaFamily", "Transformer"]
