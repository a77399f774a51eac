"""gpt-oss (``model_type: gpt_oss``) <-> ``DecoderLM``: a Llama-style stack with attention sinks (``sinks=True``),
biases on q/k/v/o, layers alternating sliding-window and full attention (``layer_types``), YaRN rotary, and an
``moe`` FFN with gpt-oss's router (``topk_softmax`` with a bias) and clamped SwiGLU experts (``clamped_swiglu``, with
biases).

Checkpoints (as ``transformers`` saves them) keep each layer's experts fused: ``mlp.experts.gate_up_proj``
``(E, H, 2·I)`` with gate and up in alternate columns, ``gate_up_proj_bias`` ``(E, 2·I)``, ``down_proj`` ``(E, I, H)``
and ``down_proj_bias`` ``(E, H)`` (input-major, the transpose of ``nn.Linear``). The converter splits them into the
zoo's per-expert linears and the exporter fuses them back. OpenAI's MXFP4 release (``*_blocks`` / ``*_scales``) is
refused: dequantize it first (``transformers``' ``Mxfp4Config(dequantize=True)``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import register_exporter, require, tensors
from .hf_checkpoint import CheckpointReader, HFConfig, rope_parameters, zoo_config
from .llama import DEFAULTS as LLAMA_DEFAULTS
from .llama import NAMES, check_attention_options, llama_fields, sliding_layer_options
from .mixtral import PLAIN_EXPERT, moe_options
from .name_maps import NameMap, read_mapped, write_mapped
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# GptOssConfig's defaults in transformers 5 (rope_parameters: its YaRN default, with rope_theta 150000).
DEFAULTS: dict[str, Any] = {
    **LLAMA_DEFAULTS, "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "sliding_window": 128, "attention_bias": True, "bos_token_id": None, "eos_token_id": None,
    "num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
    "router_aux_loss_coef": 0.001, "output_router_logits": False,
}
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
#: The expert constants the ``clamped_swiglu`` FFN computes with.
SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}

_LAYER = re.compile(r"(?P<layer>.*layers\.\d+)\.mlp\.experts\.(?P<part>gate_up_proj|down_proj)(?P<bias>_bias)?")
_SINKS = re.compile(r"layers\.(\d+)\.self_attn\.sinks")


def gpt_oss_names(n_experts: int) -> NameMap:
    """Llama's name map with the FFN replaced by ``mlp.router`` and per-expert ``mlp.experts.<e>.<linear>`` (the
    converter's unfused form of the checkpoint's fused tensors).

    Args:
        n_experts: the number of experts.

    Returns:
        The zoo -> ``transformers`` name map.
    """
    layer = {k: v for k, v in NAMES.layer.items() if not k.startswith("ffn.")}
    layer["ffn.router"] = "mlp.router"
    for e in range(n_experts):
        layer.update({f"ffn.experts.{e}.{name}": f"mlp.experts.{e}.{name}" for name in PLAIN_EXPERT})
    return dataclasses.replace(NAMES, layer=layer)


def unfuse(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Fused expert tensors -> per-expert ``nn.Linear`` weights and biases (``(out, in)``); other keys unchanged.

    Args:
        state_dict: the checkpoint's tensors.

    Returns:
        The state dict with per-expert ``gate_proj``, ``up_proj`` and ``down_proj`` tensors.

    Shapes: ``gate_up_proj`` ``(E, d_model, 2·d_ff)`` (gate and up rows interleaved) and ``down_proj``
    ``(E, d_ff, d_model)``, stored ``(in, out)``, <-> per expert ``gate_proj``/``up_proj`` ``(d_ff, d_model)`` and
    ``down_proj`` ``(d_model, d_ff)``; biases ``(E, 2·d_ff)`` / ``(E, d_model)`` likewise.
    """
    out: dict[str, Tensor] = {}
    for key, tensor in state_dict.items():
        match = _LAYER.fullmatch(key)
        if match is None:
            out[key] = tensor
            continue
        base, bias = f"{match['layer']}.mlp.experts", "bias" if match["bias"] else "weight"
        for e, t in enumerate(tensor):
            t = t if match["bias"] else t.T  # (in, out) -> nn.Linear's (out, in)
            if match["part"] == "down_proj":
                out[f"{base}.{e}.down_proj.{bias}"] = t
            else:  # gate and up interleaved along the output axis
                out[f"{base}.{e}.gate_proj.{bias}"] = t[::2].contiguous()
                out[f"{base}.{e}.up_proj.{bias}"] = t[1::2].contiguous()
    return out


def fuse(state: Mapping[str, Tensor], n_layers: int, n_experts: int, prefix: str = "model.layers") -> dict[str, Tensor]:
    """The inverse of ``unfuse`` for an exported state dict (per-expert keys replaced by the fused tensors).

    Args:
        state: the exported state dict with per-expert tensors.
        n_layers: the number of layers.
        n_experts: the number of experts per layer.
        prefix: where the layers are (``model.layers``).

    Returns:
        A new state dict with the fused tensors.

    Shapes: ``gate_up_proj`` ``(E, d_model, 2·d_ff)`` (gate and up rows interleaved) and ``down_proj``
    ``(E, d_ff, d_model)``, stored ``(in, out)``, <-> per expert ``gate_proj``/``up_proj`` ``(d_ff, d_model)`` and
    ``down_proj`` ``(d_model, d_ff)``; biases ``(E, 2·d_ff)`` / ``(E, d_model)`` likewise.
    """
    out = dict(state)
    for i in range(n_layers):
        base = f"{prefix}.{i}.mlp.experts"

        def take(e: int, name: str, kind: str, base: str = base) -> Tensor:
            return out.pop(f"{base}.{e}.{name}.{kind}")

        for kind in ("weight", "bias"):
            gate_up, down = [], []
            for e in range(n_experts):
                gate, up = take(e, "gate_proj", kind), take(e, "up_proj", kind)
                pair = torch.stack([gate, up], dim=1).flatten(0, 1)  # rows gate0, up0, gate1, ...
                gate_up.append(pair.T if kind == "weight" else pair)
                d = take(e, "down_proj", kind)
                down.append(d.T if kind == "weight" else d)
            suffix = "" if kind == "weight" else "_bias"
            out[f"{base}.gate_up_proj{suffix}"] = torch.stack(gate_up).contiguous()
            out[f"{base}.down_proj{suffix}"] = torch.stack(down).contiguous()
    return out


def _fields(cfg: HFConfig) -> dict[str, Any]:
    for key, value in SWIGLU.items():
        if float(cfg[key]) != value:
            raise cfg.unsupported(key, "the clamped SwiGLU experts' constant", f"{key}={value}")
    fields = llama_fields(cfg, default_theta=DEFAULT_ROPE["rope_theta"])
    attention: dict[str, Any] = {"sinks": True}
    if not cfg["attention_bias"]:
        attention["bias"] = False
    fields["d_ff"], ffn = moe_options(cfg, "num_local_experts", "intermediate_size", True)
    ffn.pop("renormalize")  # the softmax over the kept logits sums to 1 already
    ffn.update(router="topk_softmax", router_bias=True, expert="clamped_swiglu")
    window = None if cfg["sliding_window"] is None else cfg.positive_int("sliding_window")
    fields.update(ffn="moe", bias=True, options={**fields["options"], "attention": attention, "ffn": ffn},
                  layer_options=sliding_layer_options(cfg, fields["n_layers"], window))
    return fields


@register_converter("gpt_oss")
def convert_gpt_oss(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``GptOssForCausalLM`` checkpoint (fused expert tensors, dequantized).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: MXFP4-quantized experts, swiglu constants other than 7.0 / 1.702, layer types other than full
            and sliding attention, more experts per token than experts, or tensors that do not fit.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    data = dict(hf_config)
    if not (data.get("rope_parameters") or data.get("rope_scaling")):
        data["rope_parameters"] = DEFAULT_ROPE  # what GptOssConfig fills in
    n_layers = data.get("num_hidden_layers", DEFAULTS["num_hidden_layers"])
    data.setdefault("layer_types", ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)])
    quantized = sorted(k for k in state_dict if k.endswith(("_blocks", "_scales")))
    if quantized:
        raise ValueError(f"gpt_oss checkpoint holds MXFP4-quantized experts ({quantized[0]!r}); the zoo loads "
                         "dequantized weights: load with transformers' Mxfp4Config(dequantize=True) and save again")
    cfg = HFConfig("gpt_oss", data, DEFAULTS)
    config = zoo_config("gpt_oss", DecoderLMConfig, **_fields(cfg))
    ckpt = CheckpointReader("gpt_oss", unfuse(state_dict))
    sinks = tuple(f"layers.{i}.self_attn.sinks" for i in range(config.n_layers))  # (not a weight or bias)
    out = read_mapped(ckpt, gpt_oss_names(config.block_options("ffn")["n_experts"]), DecoderLM, config, skip=sinks)
    for key in sinks:
        out[key] = ckpt.take(f"model.{key}")
    ckpt.finish()
    return Converted(DecoderLM, config, out, frozenset())


@register_exporter("gpt_oss")
def export_gpt_oss(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``GptOssForCausalLM`` config and (fused-expert) state dict for a gpt-oss-shaped ``DecoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: parts gpt-oss lacks or lacks the other way round (no sinks, another router or expert, layer
            options other than windows, a shared expert, no biases, tied embeddings, ...).

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    require(isinstance(model, DecoderLM), f"{type(model).__name__} is not a DecoderLM")
    c = model.config
    require(c.positional == "rotary" and c.norm == "rmsnorm" and c.sublayer == "pre_norm" and c.layer == "decoder",
            "a stack other than rotary, RMSNorm, pre-norm decoder layers")
    require(c.attention == "mha" and c.d_value == c.d_head, "attention other than 'mha' with d_value == d_head")
    require(not c.scale_embeddings and c.logit_softcap is None and c.output_scale == 1.0 and not c.tie_embeddings,
            "scaled embeddings, logit soft-capping, an output scale or tied embeddings")
    require(c.ffn == "moe" and c.bias, "an ffn other than 'moe' with biases")
    attention = check_attention_options(c, {"sinks", "bias"})
    require(attention.get("sinks") is True, "attention without sinks (gpt-oss has them)")
    moe = c.block_options("ffn")
    require(not any("ffn" in entry for entry in c.layer_options), "per-layer ffn options")
    require(moe.get("router") == "topk_softmax" and moe.get("router_bias") and moe.get("expert") == "clamped_swiglu"
            and not moe.get("d_shared") and not moe.get("z_loss_coef"),
            "an MoE other than router='topk_softmax' with router_bias and 'clamped_swiglu' experts")
    windows = [entry.get("attention", {}).get("window") for entry in c.layer_options] or [None] * c.n_layers
    require(len({w for w in windows if w is not None}) <= 1, "sliding windows of different sizes")
    window = next((w for w in windows if w is not None), None)
    rotary = c.block_options("positional")
    require(set(rotary) <= {"base", "scaling"}, f"rotary options {sorted(rotary)}")
    n_experts = moe.get("n_experts", 8)
    config: dict[str, Any] = {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.d_head,
        "max_position_embeddings": c.max_len, "rms_norm_eps": c.norm_eps, "tie_word_embeddings": False,
        "attention_dropout": c.attention_dropout, "attention_bias": attention.get("bias", True),
        "rope_parameters": rope_parameters(rotary), "sliding_window": window,
        "layer_types": ["full_attention" if w is None else "sliding_attention" for w in windows],
        "num_local_experts": n_experts, "num_experts_per_tok": moe.get("top_k", 2),
        "output_router_logits": bool(moe.get("aux_loss_coef", 0.0)),
        "router_aux_loss_coef": moe.get("aux_loss_coef") or DEFAULTS["router_aux_loss_coef"], **SWIGLU,
        "pad_token_id": c.pad_token_id, "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
    }
    state = tensors(model)
    sinks = tuple(key for key in state if _SINKS.fullmatch(key))
    out = write_mapped(state, gpt_oss_names(n_experts), skip=sinks)
    out.update({f"model.{key}": state[key] for key in sinks})
    return config, fuse(out, c.n_layers, n_experts)


DecoderLM.register_preset("gpt_oss-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, n_kv_heads=2, d_head=16, d_ff=32, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary", ffn="moe", norm="rmsnorm", norm_eps=1e-5, sublayer="pre_norm", bias=True,
    tie_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=2,
    options={"positional": {"base": 150000.0, "scaling": {
        "type": "yarn", "factor": 32.0, "original_max_len": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False}},
        "attention": {"sinks": True},
        "ffn": {"n_experts": 5, "top_k": 2, "router": "topk_softmax", "router_bias": True, "expert": "clamped_swiglu"}},
    layer_options=({"attention": {"window": 8}}, {}),
))
DecoderLM.register_preset("gpt-oss-20b", dict(
    vocab_size=201088, d_model=2880, n_heads=64, n_kv_heads=8, d_head=64, d_ff=2880, n_layers=24, max_len=131072,
    dropout=0.0, positional="rotary", ffn="moe", norm="rmsnorm", norm_eps=1e-5, sublayer="pre_norm", bias=True,
    tie_embeddings=False, pad_token_id=199999, bos_token_id=None, eos_token_id=200002,
    options={"positional": {"base": 150000.0, "scaling": {
        "type": "yarn", "factor": 32.0, "original_max_len": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False}},
        "attention": {"sinks": True},
        "ffn": {"n_experts": 32, "top_k": 4, "router": "topk_softmax", "router_bias": True,
                "expert": "clamped_swiglu"}},
    layer_options=tuple({"attention": {"window": 128}} if i % 2 == 0 else {} for i in range(24)),
))

# The task classes: score on the last real token and a token classifier (no question answering).
register_tasks(TaskLayout("gpt_oss", "model.", decoder_classes("model.", None, stem="GptOss")))
