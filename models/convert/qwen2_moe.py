"""Qwen2-MoE (``model_type: qwen2_moe``) <-> ``DecoderLM``: a Qwen2 (biases on q/k/v) whose FFN is the ``moe``
block with a shared expert: routed SwiGLU experts (softmax top-k, renormalised when ``norm_topk_prob``) plus a
shared SwiGLU expert of width ``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``.
The zoo keeps that gate as the router's last row: ``mlp.gate`` and ``mlp.shared_expert_gate`` are concatenated on
loading and split on export."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import register_exporter, require
from .hf_checkpoint import HFConfig
from .llama import DEFAULTS as LLAMA_DEFAULTS
from .llama import check_attention_options, convert_llama_like, export_llama_like
from .mixtral import PLAIN_EXPERT, dense_mlps_as_shared, export_moe_fields, moe_names, moe_options, unfuse_experts
from .qwen2 import qwen_window_fields, window_layers
from .qwen3_moe import dense_layers_of, dense_of, with_num_experts
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# Qwen2MoeConfig's defaults in transformers 5.
DEFAULTS: dict[str, Any] = {
    **LLAMA_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "rope_theta": 10000.0,
    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4,
    "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False, "router_aux_loss_coef": 0.001,
    "mlp_only_layers": [], "qkv_bias": True,
}


_SHARED_GATE = re.compile(r"(?P<layer>.*layers\.\d+)\.mlp\.shared_expert_gate\.weight")


def _gate_into_router(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    # Each layer's shared_expert_gate (1, H) becomes the last row of its router mlp.gate (E + 1, H).
    out = dict(state_dict)
    for key in list(out):
        match = _SHARED_GATE.fullmatch(key)
        router = f"{match['layer']}.mlp.gate.weight" if match else None
        if router in out:
            out[router] = torch.cat([out[router], out.pop(key)])
    return out


def _qwen2_moe_fields(cfg: HFConfig, fields: dict[str, Any]) -> dict[str, Any]:
    fields["bias"] = False
    if cfg["qkv_bias"]:
        fields["options"] = {**fields["options"], "attention": {"qkv_bias": True}}
    fields["ffn"] = "moe"
    fields["d_ff"], ffn = moe_options(cfg, "num_experts", "moe_intermediate_size", cfg.boolean("norm_topk_prob"))
    ffn.update(d_shared=cfg.positive_int("shared_expert_intermediate_size"), shared_gate=True)
    fields["options"] = {**fields["options"], "ffn": ffn}
    return dense_layers_of(cfg, window_layers(cfg, fields))


@register_converter("qwen2_moe")
def convert_qwen2_moe(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``Qwen2MoeForCausalLM`` checkpoint (per-expert or fused expert tensors).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: as for Qwen2, ``mlp_only_layers`` that are not layer indices, or more experts per token than
            experts (dense layers load as in Qwen3-MoE).

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    hf_config = with_num_experts(hf_config)
    n_experts = HFConfig("qwen2_moe", hf_config, DEFAULTS).positive_int("num_experts")
    dense = dense_of(hf_config, DEFAULTS, "qwen2_moe")
    state_dict = _gate_into_router(dense_mlps_as_shared(unfuse_experts(state_dict, "mlp", PLAIN_EXPERT), dense,
                                                        "shared_expert"))
    return convert_llama_like("qwen2_moe", hf_config, state_dict, DEFAULTS, _qwen2_moe_fields,
                              names=moe_names(n_experts, "mlp", PLAIN_EXPERT, shared=True))


@register_exporter("qwen2_moe")
def export_qwen2_moe(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``Qwen2MoeForCausalLM`` config and per-expert state dict for a Qwen2-MoE-shaped ``DecoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: no gated shared expert, biases other than on q/k/v, or other parts Qwen2-MoE lacks.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    moe = model.config.block_options("ffn") if isinstance(model, DecoderLM) else {}

    def extra(c: DecoderLMConfig) -> dict[str, Any]:
        attention = check_attention_options(c, {"qkv_bias"})
        require(not c.bias, "biases on the experts (Qwen2-MoE has none)")
        require(bool(moe.get("d_shared")) and moe.get("shared_gate") is True,
                "Qwen2-MoE has a shared expert with a sigmoid gate")
        return {"qkv_bias": attention.get("qkv_bias", False), "moe_intermediate_size": c.d_ff,
                "shared_expert_intermediate_size": moe["d_shared"], "decoder_sparse_step": 1, "mlp_only_layers": [],
                **qwen_window_fields(c), **export_moe_fields(c, "num_experts", None)}

    names = moe_names(moe.get("n_experts", 8), "mlp", PLAIN_EXPERT, shared=True)
    config, state = export_llama_like(model, "qwen2_moe", "Qwen2MoeForCausalLM", extra, names=names, moe=True)
    for key in [k for k in state if k.endswith(".mlp.gate.weight")]:
        state[key], state[key.replace(".gate.", ".shared_expert_gate.")] = state[key][:-1], state[key][-1:]
    return config, state


DecoderLM.register_preset("qwen2_moe-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, n_kv_heads=2, d_ff=32, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary", ffn="moe", norm="rmsnorm", norm_eps=1e-6, sublayer="pre_norm", bias=False,
    tie_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=2,
    options={"positional": {"base": 1000000.0}, "attention": {"qkv_bias": True},
             "ffn": {"n_experts": 6, "top_k": 2, "renormalize": False, "d_shared": 48, "shared_gate": True}},
))
DecoderLM.register_preset("qwen1.5-moe-a2.7b", dict(
    vocab_size=151936, d_model=2048, n_heads=16, n_kv_heads=16, d_ff=1408, n_layers=24, max_len=8192, dropout=0.0,
    positional="rotary", ffn="moe", norm="rmsnorm", norm_eps=1e-6, sublayer="pre_norm", bias=False,
    tie_embeddings=False, pad_token_id=None, bos_token_id=151643, eos_token_id=151643,
    options={"positional": {"base": 1000000.0}, "attention": {"qkv_bias": True},
             "ffn": {"n_experts": 60, "top_k": 4, "renormalize": False, "d_shared": 5632, "shared_gate": True}},
))

# The task classes: score on the last real token, a token classifier, qa_outputs.
register_tasks(TaskLayout("qwen2_moe", "model.", decoder_classes("model.", "model.", stem="Qwen2Moe")))
