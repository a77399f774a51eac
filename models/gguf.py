"""Read llama-architecture GGUF files (llama.cpp's format) as a ``transformers`` checkpoint.

``read_gguf(path)`` gives what a ``transformers`` Llama folder would hold: the ``config.json`` dict, the state
dict under ``LlamaForCausalLM`` names, and the embedded tokenizer. ``models.from_pretrained("model.gguf")``
passes the first two to ``models.convert.from_transformers``, so a GGUF loads through the same ``llama``
converter as a ``transformers`` checkpoint.

What llama.cpp's converter changed is undone here:
- quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K ... Q6_K) are dequantized with the
  ``gguf`` package's reference decoders; F32, F16 and BF16 tensors are read as they are;
- the rows of ``attn_q`` and ``attn_k`` were permuted from rotate-half to llama.cpp's interleaved rotary
  layout (``LlamaModel.permute`` in ``convert_hf_to_gguf.py``); the inverse permutation restores them;
- Llama 3.1's ``rope_scaling`` was replaced by a ``rope_freqs`` tensor of per-frequency divisors; the
  ``llama3`` parameters are recovered from it and checked to reproduce every divisor.

The file itself (header, metadata, tensor layout) is read and checked by ``models.gguf_file``; this module checks that
its metadata and tensors form one llama model before anything is decoded. The ``gguf`` package is an optional extra
(``pip install transformer-zoo[gguf]``), imported only when a file is read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tokenization import Tokenizer

from .checkpoints.loading import register_file_format
from .checkpoints.options import parse_dtype
from .gguf_file import GGUFArray, GGUFFile, TensorInfo, import_gguf, read_gguf_file

SUPPORTED_ARCHITECTURES = ("llama",)

# ggml tensor types read here: plain floats, and every block format the gguf package decodes that
# llama.cpp's quantize writes for a llama model. (Importance-matrix "IQ" and ternary types are not.)
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

# llama.cpp tensor -> transformers LlamaForCausalLM name (the ``.weight``/``.bias`` suffix is kept).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ROPE_FREQS = "rope_freqs.weight"
# A precomputed rotary table some old files carry; the model derives it, llama.cpp ignores it too.
_IGNORED_LAYER_TENSORS = ("attn_rot_embd",)


def read_gguf(
    path: str | os.PathLike[str], dtype: str | torch.dtype | None = None
) -> tuple[dict[str, Any], dict[str, Tensor], Tokenizer | None]:
    """Read a llama-architecture GGUF file as a ``transformers`` Llama checkpoint.

    Every check runs before any tensor is decoded or any array is turned into Python objects: the header's
    counts, lengths and tensor layout against the file (``models.gguf_file``), then the architecture, tensor
    types, the sizes the metadata states against the tensors present, names and shapes, and the tokenizer
    lists' lengths against the vocabulary. Peak memory is the mapped file, the returned tensors and a few
    times the largest tensor while it is decoded; a header that claims more than its file holds fails in time
    proportional to the header.

    Args:
        path: a ``.gguf`` file (a single file; split ``-00001-of-0000N.gguf`` sets are refused, not followed).
        dtype: floating dtype of the returned tensors (``torch.dtype`` or a name such as ``"bfloat16"``).
            Default: float32, which holds every F16/BF16 value and every dequantized value exactly.

    Returns:
        ``(config, state_dict, tokenizer)``: a ``transformers`` ``config.json`` dict (``model_type`` ``"llama"``,
        sizes, ``rms_norm_eps``, ``rope_theta``, ``rope_scaling`` when the file has one, ``tie_word_embeddings``,
        ``bos/eos/pad_token_id``); tensors under ``LlamaForCausalLM`` names (``lm_head.weight`` only when the
        file has its own output matrix); the embedded tokenizer, or None when the file has no vocabulary.
        Shapes: weights as ``nn.Linear`` stores them, ``(out_features, in_features)``.

    Raises:
        ImportError: the ``gguf`` package is not installed.
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a GGUF file; a header count, string or array length, tensor dims, type, offset or size
            the file cannot hold (or overlapping tensors); an architecture other than llama; a tensor type outside
            ``SUPPORTED_TYPES``; metadata sizes that disagree with the tensors; unknown, missing or mis-shaped
            tensors; metadata the llama config cannot represent (mixture of experts, partial rotary, a
            ``rope_freqs`` tensor that is not llama3 scaling); a split file. The message names the field.
    """
    target_dtype = parse_dtype(dtype) or torch.float32
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    file = read_gguf_file(path)
    gguf = import_gguf()
    metadata = file.metadata
    splits = metadata.get("split.count", 1)
    if splits != 1:
        raise ValueError(
            f"GGUF split.count={splits!r} in {str(file.path)!r}: split sets are not followed; expected a single file "
            "(merge the parts with llama.cpp's `llama-gguf-split --merge`)"
        )
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {architecture!r} in {str(file.path)!r} is not supported; "
            f"expected one of {list(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = file.tensors
    bad_types = sorted({t.type_name for t in tensors.values()} - set(SUPPORTED_TYPES))
    if bad_types:
        which = [name for name, t in tensors.items() if t.type_name in bad_types][:5]
        raise ValueError(
            f"GGUF tensor type(s) {bad_types} (in {which}) are not supported; expected one of {list(SUPPORTED_TYPES)}"
        )

    shapes = {name: t.shape for name, t in tensors.items()}
    config, names = _config_and_names(metadata, shapes)
    tokenizer_metadata = _tokenizer_metadata(metadata, config["vocab_size"])
    rope_freqs = _decode(gguf, file, tensors[_ROPE_FREQS]) if _ROPE_FREQS in tensors else None
    if rope_freqs is not None:
        _add_llama3_rope_scaling(config, rope_freqs)
    tokenizer = None
    if tokenizer_metadata is not None:  # built before the weights are decoded: its errors come first
        from tokenization.gguf import tokenizer_from_gguf

        tokenizer = tokenizer_from_gguf(tokenizer_metadata)

    state: dict[str, Tensor] = {}
    for gguf_name, hf_name in names.items():
        weight = _decode(gguf, file, tensors[gguf_name])
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute(weight, config["num_attention_heads"])
        elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute(weight, config["num_key_value_heads"])
        state[hf_name] = weight.to(target_dtype)
    return config, state, tokenizer


def _tokenizer_metadata(metadata: Mapping[str, Any], vocab_size: int) -> dict[str, Any] | None:
    """The ``tokenizer.*`` keys with arrays decoded, after their lengths are checked against the vocabulary."""
    if "tokenizer.ggml.tokens" not in metadata:
        return None
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        value = metadata.get(key)
        if value is not None and (not isinstance(value, GGUFArray) or len(value) != vocab_size):
            got = f"{len(value)} entries" if isinstance(value, GGUFArray) else repr(value)
            raise ValueError(f"GGUF metadata {key} has {got}; expected an array of one entry per row of "
                             f"token_embd.weight ({vocab_size})")
    return {key: value.tolist() if isinstance(value, GGUFArray) else value
            for key, value in metadata.items() if key.startswith("tokenizer.")}


def _decode(gguf: Any, file: GGUFFile, tensor: TensorInfo) -> Tensor:
    """A tensor's values as float32, in torch's dimension order (ggml lists the fastest dimension first)."""
    values = gguf.quants.dequantize(file.raw(tensor), gguf.GGMLQuantizationType(tensor.type_id))
    if not values.flags.writeable:  # F32 comes back as a read-only view of the memory-mapped file
        values = values.copy()
    return torch.from_numpy(values).reshape(tensor.shape)


def _unpermute(weight: Tensor, n_heads: int) -> Tensor:
    """Undo ``convert_hf_to_gguf.LlamaModel.permute``: per head, interleaved (x0, y0, x1, y1 ...) rows
    back to rotate-half order (x0, x1 ..., y0, y1 ...).

    Shapes: ``(n_heads * d_head, ...)`` in and out.
    """
    rows = weight.shape[0]
    # (H, D/2, 2, ...) -> (H, 2, D/2, ...): the inverse of the converter's reshape(H, 2, D/2).swapaxes(1, 2)
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _meta(metadata: Mapping[str, Any], key: str, default: Any = None, *, required: bool = False) -> Any:
    value = metadata.get(key, default)
    if required and value is None:
        raise ValueError(f"the GGUF metadata has no {key!r}, which a llama model needs")
    return value


def _size(metadata: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer from the metadata (per-layer lists, as some architectures write, are refused)."""
    value = _meta(metadata, key, default, required=True)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GGUF metadata {key}={value!r}: expected a positive integer")
    return value


def _number(metadata: Mapping[str, Any], key: str, default: float | None) -> float:
    """A finite positive number from the metadata (a NaN epsilon or base would give NaN logits, silently)."""
    value = _meta(metadata, key, default, required=True)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"GGUF metadata {key}={value!r}: expected a finite positive number")
    return float(value)


def _token_id(metadata: Mapping[str, Any], key: str, vocab_size: int) -> int | None:
    value = metadata.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size):
        raise ValueError(f"GGUF metadata {key}={value!r}: expected a token id below the vocabulary size {vocab_size}")
    return value


def _agree(shapes: Mapping[str, tuple[int, ...]], key: str, value: Any, tensor: str, axis: int, per: int = 1) -> None:
    """``value`` (times ``per``, the head size for head counts) is the size of ``tensor`` along ``axis``."""
    shape = shapes.get(tensor)
    if shape is not None and (len(shape) <= axis or shape[axis] != value * per):
        times = f" (x head size {per} = {value * per})" if per != 1 else ""
        raise ValueError(f"GGUF metadata {key}={value!r}{times} disagrees with the tensor {tensor} of shape {shape}; "
                         f"expected its size along dimension {axis}")


def _config_and_names(
    metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The transformers config, and GGUF name -> transformers name for every tensor, checked against it."""
    n_layers = _size(metadata, "llama.block_count")
    d_model = _size(metadata, "llama.embedding_length")
    d_ff = _size(metadata, "llama.feed_forward_length")
    n_heads = _size(metadata, "llama.attention.head_count")
    n_kv_heads = _size(metadata, "llama.attention.head_count_kv", n_heads)
    if "llama.attention.key_length" not in metadata and d_model % n_heads:
        raise ValueError(f"GGUF llama.attention.head_count={n_heads} does not divide llama.embedding_length={d_model} "
                         "and the file states no llama.attention.key_length")
    head_dim = _size(metadata, "llama.attention.key_length", d_model // n_heads)
    experts = _meta(metadata, "llama.expert_count", 0)
    if not isinstance(experts, int) or experts > 0:
        raise ValueError(f"mixture-of-experts llama GGUF (llama.expert_count={metadata['llama.expert_count']}) "
                         "is not supported")
    value_dim = _size(metadata, "llama.attention.value_length", head_dim)
    rope_dim = _size(metadata, "llama.rope.dimension_count", head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise ValueError(
            f"llama.attention.value_length={value_dim} and llama.rope.dimension_count={rope_dim} must equal the "
            f"head size {head_dim}: a llama config has one head size and rotates the whole head"
        )
    if n_heads % n_kv_heads or head_dim % 2:
        raise ValueError(f"head_count={n_heads} must be a multiple of head_count_kv={n_kv_heads} and the head "
                         f"size {head_dim} even")
    if len(shapes.get("token_embd.weight", ())) != 2:
        raise ValueError(f"the GGUF file has no 2-D token_embd.weight tensor (got {shapes.get('token_embd.weight')})")
    vocab_size = shapes["token_embd.weight"][0]
    # The sizes the metadata states must be those of the tensors stored, before anything is built from them.
    blocks = {name.split(".")[1] for name in shapes if name.startswith("blk.")}
    if len(blocks) != n_layers or blocks != {str(i) for i in range(n_layers)}:
        raise ValueError(f"GGUF llama.block_count={n_layers}, but the file stores the blocks {sorted(blocks)[:10]} "
                         f"({len(blocks)}); expected blk.0 ... blk.{n_layers - 1}")
    _agree(shapes, "llama.embedding_length", d_model, "token_embd.weight", 1)
    _agree(shapes, "llama.vocab_size", _meta(metadata, "llama.vocab_size", vocab_size), "token_embd.weight", 0)
    _agree(shapes, "llama.feed_forward_length", d_ff, "blk.0.ffn_up.weight", 0)
    _agree(shapes, "llama.attention.head_count", n_heads, "blk.0.attn_q.weight", 0, head_dim)
    _agree(shapes, "llama.attention.head_count_kv", n_kv_heads, "blk.0.attn_k.weight", 0, head_dim)

    expected = {"token_embd.weight": (vocab_size, d_model), "output_norm.weight": (d_model,)}
    optional = {"output.weight": (vocab_size, d_model)}
    per_layer = {
        "attn_norm.weight": (d_model,), "ffn_norm.weight": (d_model,),
        "attn_q.weight": (n_heads * head_dim, d_model), "attn_k.weight": (n_kv_heads * head_dim, d_model),
        "attn_v.weight": (n_kv_heads * head_dim, d_model), "attn_output.weight": (d_model, n_heads * head_dim),
        "ffn_gate.weight": (d_ff, d_model), "ffn_up.weight": (d_ff, d_model), "ffn_down.weight": (d_model, d_ff),
    }
    attn_bias = {"attn_q.bias": (n_heads * head_dim,), "attn_k.bias": (n_kv_heads * head_dim,),
                 "attn_v.bias": (n_kv_heads * head_dim,), "attn_output.bias": (d_model,)}
    mlp_bias = {"ffn_gate.bias": (d_ff,), "ffn_up.bias": (d_ff,), "ffn_down.bias": (d_model,)}
    # transformers' attention_bias / mlp_bias switch a whole group on: all of its biases or none.
    has_attn_bias = _bias_group(shapes, attn_bias, n_layers, "attention_bias")
    has_mlp_bias = _bias_group(shapes, mlp_bias, n_layers, "mlp_bias")
    for layer in range(n_layers):
        groups = [per_layer, attn_bias if has_attn_bias else {}, mlp_bias if has_mlp_bias else {}]
        expected.update({f"blk.{layer}.{name}": shape for group in groups for name, shape in group.items()})
    optional.update({f"blk.{i}.{name}.weight": shapes.get(f"blk.{i}.{name}.weight", ())
                     for i in range(n_layers) for name in _IGNORED_LAYER_TENSORS})
    optional[_ROPE_FREQS] = (head_dim // 2,)

    unknown = sorted(set(shapes) - set(expected) - set(optional))
    missing = sorted(set(expected) - set(shapes))
    wrong = [f"{n} {shapes[n]} (expected {s})" for n, s in {**expected, **optional}.items()
             if n in shapes and shapes[n] != s]
    if unknown or missing or wrong:
        raise ValueError(
            f"the GGUF tensors do not form the llama model its metadata describes: unknown {unknown[:10]}, "
            f"missing {missing[:10]}, mis-shaped {wrong[:10]}"
        )

    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": d_model,
        "intermediate_size": d_ff,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "rms_norm_eps": _number(metadata, "llama.attention.layer_norm_rms_epsilon", None),
        "rope_theta": _number(metadata, "llama.rope.freq_base", 10000.0),  # llama.cpp's default base
        "max_position_embeddings": _size(metadata, "llama.context_length"),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in shapes,  # llama.cpp omits output.weight when tied
        "hidden_act": "silu",
        "attention_bias": has_attn_bias,
        "mlp_bias": has_mlp_bias,
        "bos_token_id": _token_id(metadata, "tokenizer.ggml.bos_token_id", vocab_size),
        "eos_token_id": _token_id(metadata, "tokenizer.ggml.eos_token_id", vocab_size),
        "pad_token_id": _token_id(metadata, "tokenizer.ggml.padding_token_id", vocab_size),
    }
    if head_dim != d_model // n_heads:
        config["head_dim"] = head_dim
    rope_scaling = _rope_scaling(metadata)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling

    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if "output.weight" in shapes:
        names["output.weight"] = "lm_head.weight"
    for gguf_name in expected:
        if gguf_name.startswith("blk."):
            _, layer, short, suffix = gguf_name.split(".")
            names[gguf_name] = f"model.layers.{layer}.{_LAYER_NAMES[short]}.{suffix}"
    return config, names


def _bias_group(shapes: Mapping[str, tuple[int, ...]], group: Mapping[str, Any], n_layers: int, flag: str) -> bool:
    present = [f"blk.{i}.{name}" for i in range(n_layers) for name in group if f"blk.{i}.{name}" in shapes]
    if present and len(present) != n_layers * len(group):
        raise ValueError(
            f"the GGUF file has only some of the biases that transformers' {flag} switches on together "
            f"({len(present)} of {n_layers * len(group)}, e.g. {present[:3]})"
        )
    return bool(present)


def _rope_scaling(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """``rope_scaling`` from the ``llama.rope.scaling.*`` keys (``rope.scale_linear`` in older files)."""
    kind = metadata.get("llama.rope.scaling.type")
    factor_key = "llama.rope.scaling.factor"
    if kind is None and metadata.get("llama.rope.scale_linear") not in (None, 1.0):
        kind, factor_key = "linear", "llama.rope.scale_linear"
    if kind in (None, "none"):
        return None
    if not isinstance(kind, str):
        raise ValueError(f"GGUF metadata llama.rope.scaling.type={kind!r}: expected a string")
    if factor_key not in metadata:
        raise ValueError(f"llama.rope.scaling.type={kind!r} without llama.rope.scaling.factor")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _number(metadata, factor_key, None)}
    if kind == "linear":
        return scaling
    # Any other type is passed on with what the file states; the converter refuses types it cannot compute.
    extra = {
        "original_context_length": ("original_max_position_embeddings", _size),
        "attn_factor": ("attention_factor", _number),
        "yarn_beta_fast": ("beta_fast", _number),
        "yarn_beta_slow": ("beta_slow", _number),
    }
    for suffix, (name, check) in extra.items():
        if f"llama.rope.scaling.{suffix}" in metadata:
            scaling[name] = check(metadata, f"llama.rope.scaling.{suffix}", None)
    return scaling


def _add_llama3_rope_scaling(config: dict[str, Any], factors: Tensor) -> None:
    """Recover Llama 3.1's ``rope_scaling`` from llama.cpp's ``rope_freqs`` divisors (in place).

    llama.cpp's converter writes, for each rotary frequency of wavelength ``w``, the divisor 1 where
    ``w < L / high``, ``factor`` where ``w > L / low``, and ``1 / ((1 - s) / factor + s)`` between, with
    ``s = (L / w - low) / (high - low)`` (as transformers' ``_compute_llama3_parameters``). ``s`` is affine in
    ``1 / w``: the divisors fix ``factor`` and that line, not ``L``, ``low`` and ``high`` one by one, so
    ``low_freq_factor`` is set to 1. Whatever the parameters, they are kept only if they reproduce every divisor.

    Raises:
        ValueError: the file also states a rope scaling type, or the divisors are not llama3's.
    """
    divisors = factors.double().tolist()
    if not all(0 < d < math.inf for d in divisors):
        raise ValueError(f"the GGUF rope_freqs tensor holds divisors that are not finite and positive: {divisors[:8]}")
    if all(d == 1.0 for d in divisors):
        return  # frequencies unchanged
    if "rope_scaling" in config:
        raise ValueError(
            f"the GGUF file has both rope_scaling {config['rope_scaling']} and a rope_freqs tensor; "
            "a llama config holds one rope scaling"
        )
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    inv_wavelen = [1 / (2 * math.pi * config["rope_theta"] ** (2 * i / head_dim)) for i in range(head_dim // 2)]
    factor = max(divisors)
    not_llama3 = ValueError(f"the GGUF rope_freqs tensor {[round(d, 4) for d in divisors]} is not llama3 rope scaling")
    if factor <= 1.0:
        raise not_llama3
    high = [u for u, d in zip(inv_wavelen, divisors, strict=True) if math.isclose(d, 1.0, rel_tol=1e-6)]
    low = [u for u, d in zip(inv_wavelen, divisors, strict=True) if math.isclose(d, factor, rel_tol=1e-6)]
    medium = [(u, (1 / d - 1 / factor) / (1 - 1 / factor)) for u, d in zip(inv_wavelen, divisors, strict=True)
              if u not in high and u not in low]
    # The line s = a * u - b (u = 1 / w, a = L / (high - low), b = low / (high - low)): s > 1 on the high
    # frequencies, s < 0 on the low ones. Two medium points fix it; with fewer, the missing ones are put on
    # the boundaries halfway between the groups, which reproduces the divisors just as well.
    if len(medium) < 2:
        top = min(high) if high else 2 * max(inv_wavelen)
        bottom = max(low)
        if medium:
            medium.append(((medium[0][0] + top) / 2, 1.0))
        else:
            medium = [(bottom + (top - bottom) / 3, 0.0), (bottom + 2 * (top - bottom) / 3, 1.0)]
    u = np.array([m[0] for m in medium])
    a, neg_b = np.linalg.lstsq(np.stack([u, np.ones_like(u)], 1), np.array([m[1] for m in medium]), rcond=None)[0]
    a, b = float(a), -float(neg_b)
    if not (a > 0 and b > 0):
        raise not_llama3
    # Readable numbers first (Llama 3.1: 8192, 1, 4), the unrounded ones if those do not reproduce the file.
    for original, high_factor in ((round(a / b), 1.0 + round(1 / b, 4)), (a / b, 1.0 + 1 / b)):
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                   "high_freq_factor": high_factor, "original_max_position_embeddings": original}
        rebuilt = _llama3_divisors(inv_wavelen, scaling)
        if all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(rebuilt, divisors, strict=True)):
            config["rope_scaling"] = scaling
            return
    raise not_llama3


def _llama3_divisors(inv_wavelen: list[float], scaling: Mapping[str, Any]) -> list[float]:
    """llama.cpp's ``rope_freqs`` for these llama3 parameters (``convert_hf_to_gguf.LlamaModel``)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    out = []
    for u in inv_wavelen:
        if 1 / u < original / high:
            out.append(1.0)
        elif 1 / u > original / low:
            out.append(factor)
        else:
            s = (original * u - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return out


# ``models.from_pretrained("model.gguf")``: read_gguf is looked up when a file is loaded (tests replace it).
register_file_format(
    ".gguf", "GGUF", lambda path, dtype: read_gguf(path, dtype=dtype),
    requires="models.gguf and the gguf package (pip install 'transformer-zoo[gguf]')",
)
