"""transformer-zoo models: ``from models import Seq2SeqTransformer, EncoderLM, DecoderLM``.

The package is layered, lowest first (each layer imports only from the ones below it; ``.importlinter`` holds the
contract ``make test`` checks): ``core`` (configs, outputs, the ``ZooModel`` base, stack helpers, adapter surgery,
quantization) ← ``generation`` and the converter registry (``convert.registry``, ``convert.export``) ←
``checkpoints``, ``auto``, ``gguf`` ← the model classes (``decoder_lm``, ``encoder_lm``, ``seq2seq``, ``vit``) ←
the families (``convert/<family>.py``) ← this file, which imports every family by name so that their converters,
exporters and presets are registered before anything is looked up. Importing it also keeps freed CPU memory
mapped for the next step (``core.allocator``; ``ZOO_KEEP_FREED_MEMORY=0`` turns that off).
"""

from . import auto, convert, gguf
from .auto import from_pretrained
from .convert import (  # noqa: F401  (each family registers its converter, exporter and presets)
    bart,
    bert,
    deepseek_v2,
    deepseek_v3,
    distilbert,
    gemma2,
    gemma3,
    gpt2,
    gpt_neox,
    gpt_oss,
    llama,
    marian,
    mistral,
    mixtral,
    modernbert,
    olmoe,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    roberta,
    t5,
    vit,
)
from .core.allocator import keep_freed_memory
from .core.base import ZooModel
from .core.config import ConfigBase, TransformerConfig
from .core.outputs import ModelOutput, Seq2SeqOutput
from .decoder_lm import DecoderLM, DecoderLMConfig
from .encoder_lm import EncoderLM, EncoderLMConfig
from .seq2seq import Seq2SeqConfig, Seq2SeqTransformer
from .vit import VisionTransformer, VisionTransformerConfig

keep_freed_memory()

__all__ = [
    "ConfigBase",
    "DecoderLM",
    "DecoderLMConfig",
    "EncoderLM",
    "EncoderLMConfig",
    "ModelOutput",
    "Seq2SeqConfig",
    "Seq2SeqOutput",
    "Seq2SeqTransformer",
    "TransformerConfig",
    "VisionTransformer",
    "VisionTransformerConfig",
    "ZooModel",
    "auto",
    "convert",
    "from_pretrained",
    "gguf",
]
