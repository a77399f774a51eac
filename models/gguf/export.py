"""Write zoo decoder models as GGUF files llama.cpp runs: the inverse of ``models.gguf.read_gguf``.

``save_gguf(model, path, dtype="Q8_0")`` (also ``DecoderLM.save_gguf``) goes through the ``transformers`` form of
the model (``models.convert.export.to_transformers``, the family exporters), then does what llama.cpp's
``convert_hf_to_gguf.py`` does with such a checkpoint, with the ``gguf`` package's own pieces:

- the architecture's metadata (``<arch>.block_count``, sizes, epsilon, RoPE base and scaling, Gemma's soft-caps and
  window ...), general.name, and the tokenizer (``tokenization.gguf.tokenizer_to_gguf``: vocabulary, merges, the
  pre-tokenizer's llama.cpp name, special ids, add BOS/EOS, chat template);
- tensor names from ``gguf.get_tensor_name_map`` (llama.cpp's own table); llama's q/k rows permuted to llama.cpp's
  interleaved rotary layout; Gemma's norms stored as ``1 + w``; GPT-2's ``Conv1D`` weights transposed; Llama 3.1's
  rope scaling as a ``rope_freqs`` tensor;
- 2-D weight matrices quantized with ``gguf.quants.quantize`` (``dtype``); norms, biases and tensors whose rows
  are not whole blocks stay F32, as llama.cpp keeps them;
- layers already held in a GGUF block format (a model loaded from a GGUF file keeps its blocks packed,
  ``blocks.quantized.ggml``) are written as their blocks, byte for byte, whatever ``dtype`` says: no second
  rounding. Other quantized layers (``int8``, ``int4``) are unpacked and written as ``dtype``.

The file is written next to its target under a hidden name, flushed and renamed over it (``os.replace``), so a
save killed at any instant leaves the old file or the new one, never a part; the next save of the same path removes
the hidden file a killed save left (``models.checkpoints.file_staging``). NaN/inf weights, and values the
chosen type would turn into inf (1e6 as F16), are refused with the tensor named.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from blocks.quantized import QuantizedEmbedding, quantized_modules
from tokenization.gguf import tokenizer_to_gguf

from ..checkpoints.atomic import fsync
from ..checkpoints.file_staging import staging_file
from ..convert.export import to_transformers
from ..core.finite import LARGEST, check_finite
from ..core.meta_build import meta_build
from .file import import_gguf
from .read import permute_rows
from .rope import llama3_divisors

#: ``dtype`` values: the ggml types the ``gguf`` package can write (it has no K-quant quantizer).
EXPORT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

# transformers model_type -> GGUF architecture (llama.cpp writes Mistral as llama).
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
         "phi3": "phi3", "gpt2": "gpt2"}


def save_gguf(model: nn.Module, path: str | os.PathLike[str], dtype: str = "F32", *, model_type: str | None = None,
              tokenizer: Any = None, name: str | None = None) -> Path:
    """Write ``model`` as one GGUF file llama.cpp (and ``read_gguf``) loads.

    Args:
        model: a zoo decoder model that a GGUF family represents exactly (llama, mistral, qwen2, qwen3, gemma2,
            phi3, gpt2); LoRA-merged models included (unmerged adapters are refused by the exporter).
        path: the ``.gguf`` file to write (replaced atomically if it exists).
        dtype: ggml type of the weight matrices, one of ``EXPORT_TYPES``.
        model_type: the ``transformers`` family to write (default: the first that represents the model).
        tokenizer: the tokenizer to embed (default: ``model.tokenizer`` when set; none otherwise).
        name: ``general.name`` (default: the family name).

    Returns:
        The path written.

    Raises:
        ValueError: an unknown ``dtype``; a model no GGUF family represents (the exporter's reason is given); a
            tokenizer llama.cpp cannot run (see ``tokenization.gguf.tokenizer_to_gguf``); a tensor holding NaN or
            inf, or values ``dtype`` turns into inf (named). The target is then untouched, and no staging file stays.
    """
    if dtype not in EXPORT_TYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {list(EXPORT_TYPES)}")
    if not isinstance(path, (str, os.PathLike)) or not str(path).lower().endswith(".gguf"):
        raise ValueError(f"path={path!r}: expected a path ending in .gguf")
    gguf = import_gguf()
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    view, packed = export_view(model)
    config, state = to_transformers(view, model_type)
    kind = config["model_type"]
    if kind not in _ARCH:
        raise ValueError(f"the model exports as transformers model_type={kind!r}, which GGUF files do not carry; "
                         f"expected one of {sorted(_ARCH)} (pass model_type= to pick one)")
    vocab = tokenizer_to_gguf(tokenizer) if tokenizer is not None else None  # its errors before any writing
    arch = _ARCH[kind]
    check_finite(state, "GGUF export")  # before anything is written (what dtype overflows: checked per tensor)
    path = Path(path)
    with staging_file(path) as staging:  # an earlier killed save's staging file of this path is removed first
        writer = gguf.GGUFWriter(str(staging), arch)
        writer.add_name(name or kind)
        # The tokenizer's own special ids win over the config's (the same keys), as llama.cpp reads one of each.
        _add_metadata(writer, gguf, kind, arch, {k: v for k, v in config.items() if not (
            vocab is not None and k in ("bos_token_id", "eos_token_id", "pad_token_id"))})
        if vocab is not None:
            for key, value in vocab.items():
                _add_value(writer, gguf, key, value)
        _add_tensors(writer, gguf, kind, arch, config, state, gguf.GGMLQuantizationType[dtype], packed)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        fsync(staging)
        os.replace(staging, path)
        fsync(path.parent)
    return path


def _add_value(writer: Any, gguf: Any, key: str, value: Any) -> None:
    """One metadata value with the GGUF type llama.cpp reads it as."""
    types = gguf.GGUFValueType
    if isinstance(value, list):
        item = types.STRING if value and isinstance(value[0], str) else (
            types.FLOAT32 if value and isinstance(value[0], float) else types.INT32)
        writer.add_key_value(key, value, types.ARRAY, sub_type=item)
    elif isinstance(value, bool):
        writer.add_key_value(key, value, types.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, types.UINT32)
    elif isinstance(value, float):
        writer.add_key_value(key, value, types.FLOAT32)
    else:
        writer.add_key_value(key, str(value), types.STRING)


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` (or the older ``rope_theta`` / ``rope_scaling``) as one dict."""
    rope = dict(config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or {}
    rope.update({k: v for k, v in scaling.items() if k != "type"})
    rope.setdefault("rope_type", scaling.get("type", "default"))
    return rope


def _add_metadata(writer: Any, gguf: Any, kind: str, arch: str, c: dict[str, Any]) -> None:
    if kind == "gpt2":
        writer.add_context_length(c["n_positions"])
        writer.add_embedding_length(c["n_embd"])
        writer.add_feed_forward_length(c.get("n_inner") or 4 * c["n_embd"])
        writer.add_block_count(c["n_layer"])
        writer.add_head_count(c["n_head"])
        writer.add_layer_norm_eps(c["layer_norm_epsilon"])
        _add_ids(writer, c)
        return
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rope = _rope(c)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c.get("num_key_value_heads") or c["num_attention_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_vocab_size(c["vocab_size"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    fraction = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor") or 1.0))
    if fraction != 1.0 and kind != "phi3":
        raise ValueError(f"partial_rotary_factor={fraction}: of the GGUF families only phi3 rotates part of the head "
                         "(pass model_type='phi3')")
    writer.add_rope_dimension_count(int(head_dim * fraction))
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope["rope_type"] != "default" and not (rope["rope_type"] == "llama3" and arch == "llama"):
        raise ValueError(f"rope_type={rope['rope_type']!r} cannot be written to a {arch} GGUF file")
    if kind == "gemma2":
        writer.add_sliding_window(c["sliding_window"])
        for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                         ("final_logit_softcapping", writer.add_final_logit_softcapping)):
            if c.get(key) is None:
                raise ValueError(f"gemma2 {key}=None: llama.cpp reads a missing value as its default, not as none")
            add(float(c[key]))
        if c.get("query_pre_attn_scalar") != head_dim:
            raise ValueError(f"gemma2 query_pre_attn_scalar={c.get('query_pre_attn_scalar')}: llama.cpp scales by "
                             f"the head size {head_dim}")
    window = c.get("sliding_window") if kind in ("mistral", "phi3") or c.get("use_sliding_window") else None
    if kind != "gemma2" and window is not None and window < c["max_position_embeddings"]:
        raise ValueError(f"{kind} sliding_window={window}: llama.cpp runs this architecture without a window, so the "
                         f"file would compute differently beyond {window} tokens")
    if kind == "phi3" and c.get("sliding_window") is not None:
        writer.add_sliding_window(c["sliding_window"])
    _add_ids(writer, c)


def _add_ids(writer: Any, c: dict[str, Any]) -> None:
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        if isinstance(c.get(key), int):
            add(c[key])


def _add_tensors(writer: Any, gguf: Any, kind: str, arch: str, c: dict[str, Any], state: dict[str, Tensor],
                 qtype: Any, packed: dict[int, Any]) -> None:
    n_layers = c.get("num_hidden_layers", c.get("n_layer"))
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, n_layers)
    rope = _rope(c)
    if kind != "gpt2" and rope["rope_type"] == "llama3":
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        inv = [1 / (2 * np.pi * rope["rope_theta"] ** (2 * i / head_dim)) for i in range(head_dim // 2)]
        writer.add_tensor("rope_freqs.weight", np.array(llama3_divisors(inv, rope), dtype=np.float32))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for hf_name, tensor in state.items():
        base, suffix = hf_name.rsplit(".", 1)
        mapped = name_map.get_name(base)
        if mapped is None:
            raise ValueError(f"no llama.cpp tensor name for {hf_name!r} of a {kind} model")
        gguf_name = f"{mapped}.{suffix}"
        if tensor.device.type == "meta":  # a layer held in GGUF blocks: its blocks, rows reordered as the floats are
            layer = packed.get(tensor.storage_offset())
            if layer is None:
                raise ValueError(f"the {kind} exporter changes {hf_name}, which this model holds in GGUF blocks; "
                                 "call model.dequantize() first")
            raw = layer.to_blocks()
            if kind in ("llama", "mistral") and mapped.endswith(("attn_q", "attn_k")):
                heads = c["num_attention_heads"] if mapped.endswith("attn_q") else c["num_key_value_heads"]
                raw = raw[permute_rows(torch.arange(raw.shape[0]), heads)]
            writer.add_tensor(gguf_name, raw.contiguous().numpy(), raw_dtype=gguf.GGMLQuantizationType[layer.ggml_type])
            continue
        weight = tensor.detach().to(torch.float32)
        if kind in ("llama", "mistral") and mapped.endswith(("attn_q", "attn_k")):
            heads = c["num_attention_heads"] if mapped.endswith("attn_q") else c["num_key_value_heads"]
            weight = permute_rows(weight, heads)
        elif kind == "gemma2" and mapped.endswith("norm") and suffix == "weight":
            weight = weight + 1
        elif kind == "gpt2" and weight.ndim == 2 and not mapped.startswith(("token_embd", "position_embd", "output")):
            weight = weight.T
        data = weight.contiguous().numpy()
        if kind == "gpt2" and gguf_name == "token_embd.weight" and "lm_head.weight" not in state:
            _add(writer, gguf, "output.weight", data, qtype, block)  # llama.cpp's GPT-2 has its own output matrix
        _add(writer, gguf, gguf_name, data, qtype, block)


def export_view(model: nn.Module) -> tuple[nn.Module, dict[int, Any]]:
    """``model`` for ``to_transformers``: ``model`` itself when it holds no quantized layers; otherwise a copy of its
    structure on the meta device holding its float tensors, where each layer held in GGUF blocks has a meta
    stand-in weight (told apart by its storage offset, which survives the exporters' renaming, ``detach`` and
    ``contiguous``) and each other quantized layer its unpacked float weight.

    Args:
        model: the zoo model to export, quantized or not.

    Returns:
        ``(the model to export, storage offset -> the packed layer)``.
    """
    layers = quantized_modules(model)
    if not layers:
        return model, {}
    with meta_build():
        view = type(model)(model.config)
    prefixes = tuple(f"{name}." for name in layers)
    floats = {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes) or k.endswith(".bias")}
    view.load_state_dict(floats, strict=False, assign=True)
    packed: dict[int, Any] = {}
    stand_ins: dict[int, nn.Parameter] = {}
    for name in layers:
        layer = model.get_submodule(name)
        table = layer.table if isinstance(layer, QuantizedEmbedding) else layer
        target = view.get_submodule(name)
        if id(table) not in stand_ins:
            if hasattr(table, "to_blocks"):
                offset = _STAND_IN_OFFSET + len(packed)
                packed[offset] = table
                weight = torch.empty(0, device="meta").as_strided(
                    tuple(target.weight.shape), (target.weight.shape[1], 1), offset)
            else:
                weight = table.unpack()
            stand_ins[id(table)] = nn.Parameter(weight, requires_grad=False)
        target.weight = stand_ins[id(table)]
    return view, packed


#: storage offsets of the stand-ins start here (far beyond any real offset of a meta tensor the exporters make).
_STAND_IN_OFFSET = 1 << 40


#: how far beyond F16's range a block format's values may go: the block scale (F16) is the largest magnitude divided
#: by this (Q4_1/Q5_1 also store the block's minimum as F16).
_SCALE_RANGE = {"F16": 1, "Q8_0": 127, "Q4_0": 8, "Q5_0": 16, "Q4_1": 1, "Q5_1": 1}


def _add(writer: Any, gguf: Any, name: str, data: np.ndarray, qtype: Any, block: int) -> None:
    if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32 and data.shape[1] % block == 0:
        if qtype.name in _SCALE_RANGE:
            check_finite({name: torch.from_numpy(data)}, "GGUF export", LARGEST["F16"] * _SCALE_RANGE[qtype.name],
                         f"{qtype.name} (F16 scales)" if qtype.name != "F16" else "F16")
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
