"""GGUF architectures -> ``transformers`` configs and tensor names: the inverse of llama.cpp's ``convert_hf_to_gguf``.

Each family llama.cpp writes under its own ``general.architecture`` (``llama``, ``qwen2``, ``qwen3``, ``gemma2``,
``phi3``, ``gpt2``, ``t5``) keeps its sizes under ``<arch>.*`` keys and its tensors under llama.cpp's names
(``token_embd``, ``blk.N.attn_q`` ...). ``hf_checkpoint_layout`` turns those into what a ``transformers`` folder of
that family holds: the ``config.json`` dict (``model_type`` picks the zoo converter at load time, so no family
module is imported here) and, per GGUF tensor, its ``transformers`` name and the change llama.cpp's converter made:

- ``permute_q`` / ``permute_k``: llama's q and k rows interleaved for llama.cpp's rotary (``LlamaModel.permute``);
- ``minus_one``: Gemma's RMSNorm weights stored as ``1 + w`` (llama.cpp's norm multiplies by the weight);
- ``transpose``: GPT-2's ``Conv1D`` weights, stored as ``nn.Linear`` would hold them.

Mistral files are llama files (llama.cpp has no mistral architecture); as ``transformers`` does, one whose
``general.name`` says mistral reads as ``model_type: mistral`` (without a sliding window: llama.cpp runs none).
Every size the metadata states is checked against the tensors, and the tensor set must be exactly the family's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .file import meta, number, size, token_id
from .rope import rope_scaling_from_metadata

#: ``general.architecture`` values read here.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "phi3", "gpt2", "t5")

_LLAMA_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# A precomputed rotary table some old files carry; the model derives it, llama.cpp ignores it too.
IGNORED_LAYER_TENSORS = ("attn_rot_embd",)
ROPE_FREQS = "rope_freqs.weight"


@dataclass
class Layout:
    """What a GGUF file is as a ``transformers`` checkpoint.

    ``names``: GGUF tensor name -> (``transformers`` name, change to undo or None), in file order of need.
    ``rope_freqs``: whether a ``rope_freqs`` tensor is to be turned into llama3 ``rope_scaling``.

    Attributes:
        config: the ``transformers`` ``config.json`` dict.
        names: GGUF tensor name -> (``transformers`` name, change to undo or None).
        rope_freqs: turn ``rope_freqs`` into ``rope_scaling``.
    """

    config: dict[str, Any]
    names: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    rope_freqs: bool = False


def architecture_of(metadata: Mapping[str, Any], path: str) -> str:
    """``general.architecture``, checked to be one read here.

    Args:
        metadata: the file's metadata.
        path: the file, for messages.

    Returns:
        The architecture.

    Raises:
        ValueError: a missing architecture or one outside ``SUPPORTED_ARCHITECTURES``, named.
    """
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {architecture!r} in {path!r} is not supported; "
                         f"expected one of {list(SUPPORTED_ARCHITECTURES)}")
    return architecture


def agree(shapes: Mapping[str, tuple[int, ...]], key: str, value: Any, tensor: str, axis: int, per: int = 1) -> None:
    """Check that ``value`` (times ``per``, the head size for head counts) is the size of ``tensor`` along ``axis``.

    Args:
        shapes: tensor name -> shape (torch order).
        key: the metadata key ``value`` comes from.
        value: the size the metadata states.
        tensor: the tensor it must agree with.
        axis: the tensor's axis.
        per: the multiplier.

    Raises:
        ValueError: they disagree (key, value, tensor and its shape named).
    """
    shape = shapes.get(tensor)
    if shape is not None and (len(shape) <= axis or shape[axis] != value * per):
        times = f" (x head size {per} = {value * per})" if per != 1 else ""
        raise ValueError(f"GGUF metadata {key}={value!r}{times} disagrees with the tensor {tensor} of shape {shape}; "
                         f"expected its size along dimension {axis}")


def _check_tensor_set(arch: str, shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]],
                      optional: Mapping[str, tuple[int, ...]]) -> None:
    unknown = sorted(set(shapes) - set(expected) - set(optional))
    missing = sorted(set(expected) - set(shapes))
    wrong = [f"{n} {shapes[n]} (expected {s})" for n, s in {**expected, **optional}.items()
             if n in shapes and shapes[n] != s]
    if unknown or missing or wrong:
        raise ValueError(f"the GGUF tensors do not form the {arch} model its metadata describes: unknown "
                         f"{unknown[:10]}, missing {missing[:10]}, mis-shaped {wrong[:10]}")


def _bias_group(shapes: Mapping[str, tuple[int, ...]], group: Mapping[str, Any], n_layers: int, flag: str) -> bool:
    present = [f"blk.{i}.{name}" for i in range(n_layers) for name in group if f"blk.{i}.{name}" in shapes]
    if present and len(present) != n_layers * len(group):
        raise ValueError(f"the GGUF file has only some of the biases that transformers' {flag} switches on together "
                         f"({len(present)} of {n_layers * len(group)}, e.g. {present[:3]})")
    return bool(present)


def _blocks(arch: str, shapes: Mapping[str, tuple[int, ...]], n_layers: int) -> None:
    blocks = {name.split(".")[1] for name in shapes if name.startswith("blk.")}
    if len(blocks) != n_layers or blocks != {str(i) for i in range(n_layers)}:
        raise ValueError(f"GGUF {arch}.block_count={n_layers}, but the file stores the blocks {sorted(blocks)[:10]} "
                         f"({len(blocks)}); expected blk.0 ... blk.{n_layers - 1}")


def _vocab(shapes: Mapping[str, tuple[int, ...]]) -> int:
    if len(shapes.get("token_embd.weight", ())) != 2:
        raise ValueError(f"the GGUF file has no 2-D token_embd.weight tensor (got {shapes.get('token_embd.weight')})")
    return shapes["token_embd.weight"][0]


def _special_ids(metadata: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
    return {f"{role}_token_id": token_id(metadata, f"tokenizer.ggml.{key}_token_id", vocab_size)
            for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))}


def hf_checkpoint_layout(metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], path: str) -> Layout:
    """The ``transformers`` config and tensor names of a GGUF file, checked against its tensors' shapes.

    Args:
        metadata: the file's metadata.
        shapes: tensor name -> shape (torch order).
        path: the file, for messages.

    Returns:
        The layout.

    Raises:
        ValueError: an architecture outside ``SUPPORTED_ARCHITECTURES``; metadata missing a required size or
            disagreeing with the tensors; unknown, missing or mis-shaped tensors; settings the family's
            ``transformers`` config cannot represent (mixture of experts, per-layer sizes ...), named.
    """
    arch = architecture_of(metadata, path)
    if arch == "gpt2":
        return _gpt2(metadata, shapes)
    if arch == "t5":
        return _t5(metadata, shapes)
    return _llama_like(arch, metadata, shapes)


def _llama_like(arch: str, metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> Layout:
    """llama (and mistral), qwen2, qwen3, gemma2 and phi3: one pre-norm decoder with per-family tensor sets."""
    n_layers = size(metadata, f"{arch}.block_count")
    d_model = size(metadata, f"{arch}.embedding_length")
    d_ff = size(metadata, f"{arch}.feed_forward_length")
    n_heads = size(metadata, f"{arch}.attention.head_count")
    n_kv_heads = size(metadata, f"{arch}.attention.head_count_kv", n_heads)
    if f"{arch}.attention.key_length" not in metadata and d_model % n_heads:
        raise ValueError(f"GGUF {arch}.attention.head_count={n_heads} does not divide {arch}.embedding_length="
                         f"{d_model} and the file states no {arch}.attention.key_length")
    head_dim = size(metadata, f"{arch}.attention.key_length", d_model // n_heads)
    experts = meta(metadata, f"{arch}.expert_count", 0)
    if not isinstance(experts, int) or experts > 0:
        raise ValueError(f"mixture-of-experts {arch} GGUF ({arch}.expert_count={experts!r}) is not supported")
    value_dim = size(metadata, f"{arch}.attention.value_length", head_dim)
    rope_dim = size(metadata, f"{arch}.rope.dimension_count", head_dim)
    if value_dim != head_dim or (rope_dim != head_dim and arch != "phi3"):
        raise ValueError(f"{arch}.attention.value_length={value_dim} and {arch}.rope.dimension_count={rope_dim} must "
                         f"equal the head size {head_dim}: the {arch} config has one head size and rotates the whole "
                         "head")
    if n_heads % n_kv_heads or head_dim % 2 or rope_dim % 2 or rope_dim > head_dim:
        raise ValueError(f"{arch}.attention.head_count={n_heads} must be a multiple of head_count_kv={n_kv_heads}, "
                         f"and the head size {head_dim} and rotary size {rope_dim} even, the latter at most the former")
    vocab_size = _vocab(shapes)
    _blocks(arch, shapes, n_layers)
    q_rows, kv_rows = n_heads * head_dim, n_kv_heads * head_dim
    agree(shapes, f"{arch}.embedding_length", d_model, "token_embd.weight", 1)
    agree(shapes, f"{arch}.vocab_size", meta(metadata, f"{arch}.vocab_size", vocab_size), "token_embd.weight", 0)
    agree(shapes, f"{arch}.feed_forward_length", d_ff, "blk.0.ffn_down.weight", 1)
    if arch == "phi3":
        agree(shapes, f"{arch}.attention.head_count + 2 x head_count_kv", n_heads + 2 * n_kv_heads,
              "blk.0.attn_qkv.weight", 0, head_dim)
    else:
        agree(shapes, f"{arch}.attention.head_count", n_heads, "blk.0.attn_q.weight", 0, head_dim)
        agree(shapes, f"{arch}.attention.head_count_kv", n_kv_heads, "blk.0.attn_k.weight", 0, head_dim)

    layer = dict(_LLAMA_LAYER)
    shape = {"attn_norm": (d_model,), "ffn_norm": (d_model,), "attn_q": (q_rows, d_model),
             "attn_k": (kv_rows, d_model), "attn_v": (kv_rows, d_model), "attn_output": (d_model, q_rows),
             "ffn_gate": (d_ff, d_model), "ffn_up": (d_ff, d_model), "ffn_down": (d_model, d_ff)}
    attn_bias = {"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,),
                 "attn_output.bias": (d_model,)}
    mlp_bias = {"ffn_gate.bias": (d_ff,), "ffn_up.bias": (d_ff,), "ffn_down.bias": (d_model,)}
    if arch == "qwen2":  # Qwen2 always has q, k and v biases, never an output or MLP bias
        attn_bias.pop("attn_output.bias")
        mlp_bias = {}
    elif arch == "qwen3":
        layer.update(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
        shape.update(attn_q_norm=(head_dim,), attn_k_norm=(head_dim,))
        mlp_bias = {}
    elif arch == "gemma2":
        layer.update(ffn_norm="pre_feedforward_layernorm", post_attention_norm="post_attention_layernorm",
                     post_ffw_norm="post_feedforward_layernorm")
        shape.update(post_attention_norm=(d_model,), post_ffw_norm=(d_model,))
        attn_bias, mlp_bias = {}, {}
    elif arch == "phi3":  # fused q|k|v and gate|up, as Phi3ForCausalLM stores them
        for name in ("attn_q", "attn_k", "attn_v", "ffn_gate"):
            layer.pop(name), shape.pop(name)
        layer.update(attn_qkv="self_attn.qkv_proj", ffn_up="mlp.gate_up_proj")
        shape.update(attn_qkv=(q_rows + 2 * kv_rows, d_model), ffn_up=(2 * d_ff, d_model))
        attn_bias, mlp_bias = {}, {}

    expected = {"token_embd.weight": (vocab_size, d_model), "output_norm.weight": (d_model,)}
    optional = {"output.weight": (vocab_size, d_model)}
    if arch == "qwen2":
        has_attn_bias = True
    else:
        has_attn_bias = _bias_group(shapes, attn_bias, n_layers, "attention_bias")
    has_mlp_bias = _bias_group(shapes, mlp_bias, n_layers, "mlp_bias")
    for i in range(n_layers):
        expected.update({f"blk.{i}.{name}.weight": s for name, s in shape.items()})
        if has_attn_bias:
            expected.update({f"blk.{i}.{name}": s for name, s in attn_bias.items()})
        if has_mlp_bias:
            expected.update({f"blk.{i}.{name}": s for name, s in mlp_bias.items()})
        optional.update({f"blk.{i}.{name}.weight": shapes.get(f"blk.{i}.{name}.weight", ())
                         for name in IGNORED_LAYER_TENSORS})
    if arch == "llama":
        optional[ROPE_FREQS] = (head_dim // 2,)
    _check_tensor_set(arch, shapes, expected, optional)

    model_type = arch
    if arch == "llama" and "mistral" in str(metadata.get("general.name", "")).lower():
        model_type = "mistral"
    tied = "output.weight" not in shapes  # llama.cpp omits output.weight when tied
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                           "phi3": "Phi3ForCausalLM"}[model_type]],
        "hidden_size": d_model, "intermediate_size": d_ff, "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
        "rms_norm_eps": number(metadata, f"{arch}.attention.layer_norm_rms_epsilon", None),
        "rope_theta": number(metadata, f"{arch}.rope.freq_base", 10000.0),  # llama.cpp's default base
        "max_position_embeddings": size(metadata, f"{arch}.context_length"),
        "vocab_size": vocab_size, "tie_word_embeddings": tied, "hidden_act": "silu",
        **_special_ids(metadata, vocab_size),
    }
    if head_dim != d_model // n_heads or arch in ("qwen3", "gemma2"):
        config["head_dim"] = head_dim
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = has_attn_bias
    if arch == "llama":
        config["mlp_bias"] = has_mlp_bias
    if model_type == "mistral":
        config["sliding_window"] = None
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if arch == "phi3":
        config["sliding_window"] = meta(metadata, f"{arch}.attention.sliding_window")
        if rope_dim != head_dim:
            config["partial_rotary_factor"] = rope_dim / head_dim
    if arch == "gemma2":
        config.pop("hidden_act")
        window = size(metadata, f"{arch}.attention.sliding_window", 4096)
        config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim, sliding_window=window,
                      attn_logit_softcapping=meta(metadata, f"{arch}.attn_logit_softcapping"),
                      final_logit_softcapping=meta(metadata, f"{arch}.final_logit_softcapping"))
        if not tied:
            raise ValueError("a gemma2 GGUF with its own output.weight: Gemma 2 ties the output to the embedding")
    rope_scaling = rope_scaling_from_metadata(metadata, arch)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling

    names: dict[str, tuple[str, str | None]] = {"token_embd.weight": ("model.embed_tokens.weight", None),
                                               "output_norm.weight": ("model.norm.weight", None)}
    if not tied:
        names["output.weight"] = ("lm_head.weight", None)
    for gguf_name in expected:
        if gguf_name.startswith("blk."):
            _, index, short, suffix = gguf_name.split(".")
            change = None
            if arch == "llama" and short in ("attn_q", "attn_k"):
                change = "permute_q" if short == "attn_q" else "permute_k"
            elif arch == "gemma2" and short.endswith("norm"):
                change = "minus_one"
            names[gguf_name] = (f"model.layers.{index}.{layer[short]}.{suffix}", change)
    if arch == "gemma2":
        names["output_norm.weight"] = ("model.norm.weight", "minus_one")
    return Layout(config, names, rope_freqs=ROPE_FREQS in shapes)


_GPT2_LAYER = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
               "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}


def _gpt2(metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> Layout:
    n_layers = size(metadata, "gpt2.block_count")
    d_model = size(metadata, "gpt2.embedding_length")
    d_ff = size(metadata, "gpt2.feed_forward_length", 4 * d_model)
    n_heads = size(metadata, "gpt2.attention.head_count")
    n_ctx = size(metadata, "gpt2.context_length")
    if d_model % n_heads:
        raise ValueError(f"GGUF gpt2.attention.head_count={n_heads} does not divide gpt2.embedding_length={d_model}")
    vocab_size = _vocab(shapes)
    _blocks("gpt2", shapes, n_layers)
    agree(shapes, "gpt2.embedding_length", d_model, "token_embd.weight", 1)
    agree(shapes, "gpt2.context_length", n_ctx, "position_embd.weight", 0)
    agree(shapes, "gpt2.feed_forward_length", d_ff, "blk.0.ffn_up.weight", 0)
    expected = {"token_embd.weight": (vocab_size, d_model), "position_embd.weight": (n_ctx, d_model),
                "output_norm.weight": (d_model,), "output_norm.bias": (d_model,)}
    per_layer = {"attn_norm.weight": (d_model,), "attn_norm.bias": (d_model,), "ffn_norm.weight": (d_model,),
                 "ffn_norm.bias": (d_model,), "attn_qkv.weight": (3 * d_model, d_model),
                 "attn_qkv.bias": (3 * d_model,),
                 "attn_output.weight": (d_model, d_model), "attn_output.bias": (d_model,),
                 "ffn_up.weight": (d_ff, d_model), "ffn_up.bias": (d_ff,), "ffn_down.weight": (d_model, d_ff),
                 "ffn_down.bias": (d_model,)}
    for i in range(n_layers):
        expected.update({f"blk.{i}.{name}": s for name, s in per_layer.items()})
    _check_tensor_set("gpt2", shapes, expected, {"output.weight": (vocab_size, d_model)})
    config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": n_layers, "n_embd": d_model,
        "n_head": n_heads, "n_positions": n_ctx, "n_inner": d_ff, "vocab_size": vocab_size,
        "layer_norm_epsilon": number(metadata, "gpt2.attention.layer_norm_epsilon", None),
        "activation_function": "gelu_new", "tie_word_embeddings": "output.weight" not in shapes,
        **_special_ids(metadata, vocab_size),
    }
    names: dict[str, tuple[str, str | None]] = {
        "token_embd.weight": ("transformer.wte.weight", None), "position_embd.weight": ("transformer.wpe.weight", None),
        "output_norm.weight": ("transformer.ln_f.weight", None), "output_norm.bias": ("transformer.ln_f.bias", None),
    }
    if "output.weight" in shapes:
        names["output.weight"] = ("lm_head.weight", None)
    for gguf_name in expected:
        if gguf_name.startswith("blk."):
            _, index, short, suffix = gguf_name.split(".")
            change = "transpose" if suffix == "weight" and short not in ("attn_norm", "ffn_norm") else None
            names[gguf_name] = (f"transformer.h.{index}.{_GPT2_LAYER[short]}.{suffix}", change)
    return Layout(config, names)


_T5_ATTENTION = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_o": "o"}
_T5_FFN = {"ffn_gate": "wi_0", "ffn_up": "wi_1", "ffn_down": "wo"}


def _t5(metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> Layout:
    """T5 (1.0 and 1.1/Flan): llama.cpp's ``enc.blk.N`` / ``dec.blk.N`` tensors as ``T5ForConditionalGeneration``."""
    n_layers = size(metadata, "t5.block_count")
    d_model = size(metadata, "t5.embedding_length")
    d_ff = size(metadata, "t5.feed_forward_length")
    n_heads = size(metadata, "t5.attention.head_count")
    d_kv = size(metadata, "t5.attention.key_length", d_model // n_heads)
    buckets = size(metadata, "t5.attention.relative_buckets_count", 32)
    eps_key = "t5.attention.layer_norm_rms_epsilon"
    if eps_key not in metadata:
        eps_key = "t5.attention.layer_norm_epsilon"
    vocab_size = _vocab(shapes)
    n_decoder = len({name.split(".")[2] for name in shapes if name.startswith("dec.blk.")})
    gated = "enc.blk.0.ffn_gate.weight" in shapes
    inner = n_heads * d_kv
    attention = {"attn_q": (inner, d_model), "attn_k": (inner, d_model), "attn_v": (inner, d_model),
                 "attn_o": (d_model, inner)}
    ffn = {"ffn_up": (d_ff, d_model), "ffn_down": (d_model, d_ff), **({"ffn_gate": (d_ff, d_model)} if gated else {})}
    expected = {"token_embd.weight": (vocab_size, d_model), "enc.output_norm.weight": (d_model,),
                "dec.output_norm.weight": (d_model,), "enc.blk.0.attn_rel_b.weight": (buckets, n_heads),
                "dec.blk.0.attn_rel_b.weight": (buckets, n_heads)}
    names: dict[str, tuple[str, str | None]] = {
        "token_embd.weight": ("shared.weight", None),
        "enc.output_norm.weight": ("encoder.final_layer_norm.weight", None),
        "dec.output_norm.weight": ("decoder.final_layer_norm.weight", None),
        "enc.blk.0.attn_rel_b.weight": ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", None),
        "dec.blk.0.attn_rel_b.weight": ("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", None),
    }
    for stack, count, ffn_index in (("enc", n_layers, 1), ("dec", n_decoder, 2)):
        hf = "encoder" if stack == "enc" else "decoder"
        for i in range(count):
            block = f"{hf}.block.{i}.layer"
            parts = {"attn_norm": ((d_model,), f"{block}.0.layer_norm"),
                     "ffn_norm": ((d_model,), f"{block}.{ffn_index}.layer_norm")}
            parts.update({k: (s, f"{block}.0.SelfAttention.{v}") for k, s in attention.items()
                          for v in [_T5_ATTENTION[k]]})
            ffn_names = {**_T5_FFN, "ffn_up": "wi_1" if gated else "wi"}  # T5 1.0's one input matrix is "wi"
            parts.update({k: (s, f"{block}.{ffn_index}.DenseReluDense.{ffn_names[k]}") for k, s in ffn.items()})
            if stack == "dec":
                parts["cross_attn_norm"] = ((d_model,), f"{block}.1.layer_norm")
                parts.update({f"cross_{k}": (s, f"{block}.1.EncDecAttention.{_T5_ATTENTION[k]}")
                              for k, s in attention.items()})
            for short, (shape, hf_name) in parts.items():
                expected[f"{stack}.blk.{i}.{short}.weight"] = shape
                names[f"{stack}.blk.{i}.{short}.weight"] = (f"{hf_name}.weight", None)
    _check_tensor_set("t5", shapes, expected, {"output.weight": (vocab_size, d_model)})
    if "output.weight" in shapes:
        names["output.weight"] = ("lm_head.weight", None)
    config = {
        "model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True,
        "d_model": d_model, "d_ff": d_ff, "d_kv": d_kv, "num_heads": n_heads, "num_layers": n_layers,
        "num_decoder_layers": n_decoder, "relative_attention_num_buckets": buckets, "vocab_size": vocab_size,
        "layer_norm_epsilon": number(metadata, eps_key, None), "n_positions": size(metadata, "t5.context_length", 512),
        "feed_forward_proj": "gated-gelu" if gated else "relu", "tie_word_embeddings": "output.weight" not in shapes,
        "decoder_start_token_id": token_id(metadata, "t5.decoder_start_token_id", vocab_size) or 0,
        **_special_ids(metadata, vocab_size),
    }
    config.pop("bos_token_id")
    return Layout(config, names)
