"""Llama (``model_type: llama``) <-> ``DecoderLM``, and the machinery its descendants share.

A Llama is a ``DecoderLM`` with rotary positions, RMSNorm, pre-norm sublayers, a SwiGLU FFN, no biases and
(usually) grouped key/value heads. Mistral (sliding windows), Qwen2 (biases on q/k/v) and Qwen3 (per-head q/k
RMSNorm) differ only in block options, so their converters (``mistral.py``, ``qwen2.py``, ``qwen3.py``) call
``convert_llama_like`` / ``export_llama_like`` with their defaults and differences.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import register_exporter, require, tensors
from .hf_checkpoint import CheckpointReader, HFConfig, rope_parameters, zoo_config
from .name_maps import NameMap, read_mapped, write_mapped
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# LlamaConfig's defaults in transformers 5 (fields a config.json may leave out).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "attention_dropout": 0.0, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,
    "pretraining_tp": 1,
}

# transformers' gated activations -> the zoo's gated FFNs (act(gate_proj(x)) * up_proj(x)).
GATED_FFNS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh",
              "gelu_new": "geglu_tanh", "gelu_fast": "geglu_tanh"}
GATED_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh"}

NAMES = NameMap(
    top={"embed_tokens": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"},
    layer={
        "self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.k_proj",
        "self_attn.v_proj": "self_attn.v_proj", "self_attn.o_proj": "self_attn.o_proj",
        "self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm",
        "ffn.gate_proj": "mlp.gate_proj", "ffn.up_proj": "mlp.up_proj", "ffn.down_proj": "mlp.down_proj",
        "self_attn_sublayer.norm": "input_layernorm", "ffn_sublayer.norm": "post_attention_layernorm",
    },
    stacks={"layers": "model.layers.{i}"},
)

#: A family hook: (HFConfig, zoo config fields so far) -> the fields with the family's changes.
FieldsHook = Callable[[HFConfig, dict[str, Any]], dict[str, Any]]


def llama_fields(cfg: HFConfig, default_theta: float = 10000.0) -> dict[str, Any]:
    """The ``DecoderLMConfig`` fields of a Llama-style checkpoint (every family here starts from them).

    Args:
        cfg: the checkpoint's config.
        default_theta: the RoPE base when the config names none.

    Returns:
        The fields, as keyword arguments of ``DecoderLMConfig``.

    Raises:
        ValueError: an activation with no gated zoo FFN, ``pretraining_tp`` other than 1 is fine (it only split
            matmuls), an unsupported RoPE type, or fields of the wrong type.
    """
    d_model = cfg.positive_int("hidden_size")
    n_heads = cfg.positive_int("num_attention_heads")
    n_kv_heads = n_heads if cfg["num_key_value_heads"] is None else cfg.positive_int("num_key_value_heads")
    d_head = d_model // n_heads if cfg["head_dim"] is None else cfg.positive_int("head_dim")
    act = cfg["hidden_act"]
    if act not in GATED_FFNS:
        raise cfg.unsupported("hidden_act", "the gated FFN's activation", "the activations " + ", ".join(GATED_FFNS))
    options: dict[str, dict[str, Any]] = {"positional": cfg.rope_options(default_theta)}
    attention_bias, mlp_bias = bool(cfg["attention_bias"]), bool(cfg["mlp_bias"])
    if attention_bias != mlp_bias:
        options["attention"] = {"bias": attention_bias}
    return dict(
        vocab_size=cfg.positive_int("vocab_size"), d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
        d_head=d_head, d_ff=cfg.positive_int("intermediate_size"), n_layers=cfg.positive_int("num_hidden_layers"),
        max_len=cfg.positive_int("max_position_embeddings"), dropout=0.0,
        attention_dropout=cfg.probability("attention_dropout"), positional="rotary", ffn=GATED_FFNS[act],
        norm="rmsnorm", norm_eps=float(cfg["rms_norm_eps"]), sublayer="pre_norm", bias=mlp_bias,
        tie_embeddings=bool(cfg["tie_word_embeddings"]), options=options,
        **cfg.token_ids("pad_token_id", "bos_token_id", "eos_token_id"),
    )


def sliding_layer_options(cfg: HFConfig, n_layers: int, window: int | None) -> tuple[dict[str, Any], ...]:
    """Per-layer sliding windows from ``layer_types`` (transformers 5): a window on ``"sliding_attention"`` layers.

    Args:
        cfg: the checkpoint's config.
        n_layers: the number of layers.
        window: the sliding window, or None (then no per-layer options).

    Returns:
        One ``layer_options`` entry per layer, or ``()`` without ``layer_types`` or a window.

    Raises:
        ValueError: a layer type other than full and sliding attention, or a list of the wrong length.
    """
    types = cfg.data.get("layer_types")
    if types is None or window is None:
        return ()
    if len(types) != n_layers or set(types) - {"full_attention", "sliding_attention"}:
        raise cfg.unsupported("layer_types", "per-layer attention types", "full_attention and sliding_attention")
    return tuple({"attention": {"window": window}} if t == "sliding_attention" else {} for t in types)


def convert_llama_like(
    model_type: str,
    hf_config: Mapping[str, Any],
    state_dict: Mapping[str, Tensor],
    defaults: Mapping[str, Any],
    fields_hook: FieldsHook | None = None,
    default_theta: float = 10000.0,
    names: NameMap = NAMES,
) -> Converted:
    """Convert a checkpoint of a Llama-style family: Llama's fields, then the family's ``fields_hook``.

    Args:
        model_type: the family.
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.
        defaults: the family's config defaults.
        fields_hook: changes the fields for the family (None: Llama's as they are).
        default_theta: the RoPE base when the config names none.
        names: the zoo -> ``transformers`` tensor names.

    Returns:
        The zoo ``DecoderLM``, its config and state dict.

    Raises:
        ValueError: as ``convert_llama``, or what ``fields_hook`` refuses.

    Shapes: each tensor keeps its shape (the tensors are renamed).
    """
    cfg = HFConfig(model_type, hf_config, defaults)
    fields = llama_fields(cfg, default_theta)
    if fields_hook is not None:
        fields = fields_hook(cfg, fields)
    config = zoo_config(model_type, DecoderLMConfig, **fields)
    # rotary_emb.inv_freq: a buffer some versions saved.
    ckpt = CheckpointReader(model_type, state_dict, ignore=[r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"])
    tied = config.tie_embeddings
    out = read_mapped(ckpt, names, DecoderLM, config, skip=("lm_head.weight",) if tied else ())
    allow_missing: frozenset[str] = frozenset()
    if tied:
        ckpt.skip("lm_head.weight")  # the tied copy some versions save
    ckpt.finish()
    return Converted(DecoderLM, config, out, allow_missing)


def export_llama_like(
    model: nn.Module, model_type: str, architecture: str, extra: Callable[[DecoderLMConfig], dict[str, Any]],
    names: NameMap = NAMES, moe: bool = False,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The Llama-style part of an export: config fields every family shares, and the renamed tensors.

    ``extra(config)`` returns the family's own config fields (and raises ``NotExportable`` for what it lacks).
    ``moe=True``: the FFN must be the ``moe`` block, whose experts' FFN gives ``hidden_act``.

    Args:
        model: the zoo ``DecoderLM``.
        model_type: the family.
        architecture: the ``transformers`` class name to record.
        extra: the family's own config fields.
        names: the zoo -> ``transformers`` tensor names.
        moe: whether the FFN is a mixture of experts.

    Returns:
        ``(config, state_dict)`` under ``transformers`` names.

    Raises:
        NotExportable: a model with parts Llama-style families lack, or what ``extra`` refuses.

    Shapes: each tensor keeps its shape (the tensors are renamed).
    """
    require(isinstance(model, DecoderLM), f"{type(model).__name__} is not a DecoderLM")
    c = model.config
    require(c.positional == "rotary", f"positional={c.positional!r} (only 'rotary')")
    require(c.norm == "rmsnorm", f"norm={c.norm!r} (only 'rmsnorm')")
    require(c.sublayer == "pre_norm", f"sublayer={c.sublayer!r} (only 'pre_norm')")
    require(c.layer == "decoder", f"layer={c.layer!r} (only 'decoder')")
    require((c.ffn == "moe") == moe, f"ffn={c.ffn!r} ({'only' if moe else 'not'} 'moe')")
    ffn = c.block_options("ffn").get("expert", "swiglu") if moe else c.ffn
    require(ffn in GATED_ACTIVATIONS, f"ffn={ffn!r} (one of {sorted(GATED_ACTIVATIONS)})")
    require(c.attention == "mha" and c.d_value == c.d_head, "attention other than 'mha' with d_value == d_head")
    require(not c.scale_embeddings and c.logit_softcap is None and c.output_scale == 1.0,
            "scaled embeddings, logit soft-capping or an output scale")
    rotary = c.block_options("positional")
    require(set(rotary) <= {"base", "scaling", "fraction"}, f"rotary options {sorted(rotary)}")
    rope = rope_parameters(rotary)
    config: dict[str, Any] = {
        "model_type": model_type, "architectures": [architecture], "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.d_head,
        "hidden_act": GATED_ACTIVATIONS[ffn], "max_position_embeddings": c.max_len, "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings, "attention_dropout": c.attention_dropout,
        "rope_parameters": rope, "rope_theta": rope["rope_theta"], "pad_token_id": c.pad_token_id,
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
    }
    config.update(extra(c))
    state = tensors(model)
    out = write_mapped(state, names, skip=("lm_head.weight",) if c.tie_embeddings else ())
    return config, out


def check_attention_options(config: DecoderLMConfig, allowed: set[str]) -> dict[str, Any]:
    """The attention options shared by every layer; ``NotExportable`` for options outside ``allowed``.

    Args:
        config: the zoo model's config.
        allowed: the attention options the family writes.

    Returns:
        The model's attention options.

    Raises:
        NotExportable: options outside ``allowed``, or per-layer options other than a window.
    """
    options = config.block_options("attention")
    require(set(options) <= allowed, f"attention options {sorted(set(options) - allowed)}")
    for i, entry in enumerate(config.layer_options):
        require(set(entry) <= {"attention"} and set(entry.get("attention", {})) <= {"window"},
                f"layer_options[{i}] = {entry}")
    return options


@register_converter("llama")
def convert_llama(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``LlamaForCausalLM`` (or ``LlamaModel``) checkpoint: Llama 1/2/3, ``rope_scaling`` types
    ``linear`` and ``llama3``, any ``head_dim``, tied or untied embeddings, ``attention_bias``/``mlp_bias``.

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: another RoPE type (``yarn``, ``dynamic``, ...), an activation without a gated zoo FFN, or weights
            that do not fit the config.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    return convert_llama_like("llama", hf_config, state_dict, DEFAULTS)


@register_exporter("llama")
def export_llama(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``LlamaForCausalLM`` config and state dict for a Llama-shaped ``DecoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: a model with parts Llama lacks (non-rotary positions, LayerNorm, sliding windows, ...).

    Shapes: each tensor in the ``transformers`` layout of its module.
    """

    def extra(c: DecoderLMConfig) -> dict[str, Any]:
        attention = check_attention_options(c, {"bias"})
        require(not c.layer_options, "per-layer options (Llama has the same layers throughout)")
        require("bias" not in attention or c.bias is False, "biases on the FFN but not on the attention")
        return {"attention_bias": attention.get("bias", c.bias), "mlp_bias": c.bias}

    return export_llama_like(model, "llama", "LlamaForCausalLM", extra)


# A tiny Llama for tests (GQA, untied) and Llama 3.2 1B's published shape.
DecoderLM.register_preset("llama-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary", ffn="swiglu", norm="rmsnorm", norm_eps=1e-5, sublayer="pre_norm", bias=False,
    tie_embeddings=False, pad_token_id=None, bos_token_id=1, eos_token_id=2,
    options={"positional": {"base": 500000.0}},
))
DecoderLM.register_preset("llama-3.2-1b", dict(
    vocab_size=128256, d_model=2048, n_heads=32, n_kv_heads=8, d_head=64, d_ff=8192, n_layers=16, max_len=131072,
    dropout=0.0, positional="rotary", ffn="swiglu", norm="rmsnorm", norm_eps=1e-5, sublayer="pre_norm", bias=False,
    tie_embeddings=True, pad_token_id=None, bos_token_id=128000, eos_token_id=128001,
    options={"positional": {"base": 500000.0, "scaling": {
        "type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_len": 8192,
    }}},
))

# The task classes: score on the last real token, a token classifier, qa_outputs.
register_tasks(TaskLayout("llama", "model.", decoder_classes("model.", "transformer.", stem="Llama")))
