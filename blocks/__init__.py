"""transformer-zoo building blocks, addressable by registry name.

``blocks.get(kind, name)``, ``blocks.build(kind, name, **cfg)``, ``blocks.names(kind)``, ``blocks.kinds()``.
Importing this package registers every component.
"""

from . import adapters, backends, ffn, heads, masks, moe, norm, patch_embedding, positional, quantized, sublayer  # noqa: F401  (registers components)
from .attention import MultiHeadAttention
from .kv_cache import KVCache, LayerCache, StaticKVCache, reorder_caches
from .latent_attention import MultiHeadLatentAttention
from .latent_cache import LatentKVCache
from .layers import DecoderLayer, EncoderLayer, decoder_layer, encoder_layer
from .masks import causal_mask, document_mask, padding_mask, prefix_lm_mask, sliding_window_mask
from .paged_cache import BlockAllocator, PagedBatch, PagedKVCache, PagedLayerCache
from .registry import build, check_kwargs, get, kinds, names, register

__all__ = [
    "BlockAllocator",
    "DecoderLayer",
    "EncoderLayer",
    "KVCache",
    "LatentKVCache",
    "LayerCache",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "PagedBatch",
    "PagedKVCache",
    "PagedLayerCache",
    "StaticKVCache",
    "build",
    "causal_mask",
    "check_kwargs",
    "decoder_layer",
    "document_mask",
    "encoder_layer",
    "get",
    "kinds",
    "names",
    "padding_mask",
    "prefix_lm_mask",
    "register",
    "reorder_caches",
    "sliding_window_mask",
]
