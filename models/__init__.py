"""transformer-zoo models: ``from models import Seq2SeqTransformer, EncoderLM, DecoderLM``."""

from . import convert  # registers every family's converter, exporter and presets
from .auto import from_pretrained
from .base import ZooModel
from .config import ConfigBase, TransformerConfig
from .decoder_lm import DecoderLM, DecoderLMConfig
from .encoder_lm import EncoderLM, EncoderLMConfig
from .outputs import ModelOutput, Seq2SeqOutput
from .seq2seq import Seq2SeqConfig, Seq2SeqTransformer
from .vit import VisionTransformer, VisionTransformerConfig

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
    "convert",
    "ZooModel",
    "from_pretrained",
]
