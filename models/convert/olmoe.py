"""OLMoE (``model_type: olmoe``) <-> ``DecoderLM``: a Llama whose q and k projections are RMS-normalised over their
whole width (``qk_norm_scope="projection"``, not per head as in Qwen3) and whose FFN is the ``moe`` block (softmax
top-k router, kept weights renormalised only with ``norm_topk_prob``, SwiGLU experts)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import register_exporter, require
from .hf_checkpoint import HFConfig
from .llama import DEFAULTS as LLAMA_DEFAULTS
from .llama import check_attention_options, convert_llama_like, export_llama_like
from .mixtral import PLAIN_EXPERT, export_moe_fields, moe_names, moe_options, unfuse_experts
from .registry import Converted, register_converter

# OlmoeConfig's defaults in transformers 5.
DEFAULTS: dict[str, Any] = {
    **LLAMA_DEFAULTS, "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "pad_token_id": 1,
    "bos_token_id": None, "eos_token_id": 50279, "rope_theta": 10000.0, "clip_qkv": None, "num_experts_per_tok": 8,
    "num_experts": 64, "output_router_logits": False, "router_aux_loss_coef": 0.01, "norm_topk_prob": False,
}

#: The attention options of every OLMoE: RMSNorm over the whole q and k projections.
QK_NORM = {"qk_norm": "rmsnorm", "qk_norm_scope": "projection"}


def _olmoe_fields(cfg: HFConfig, fields: dict[str, Any]) -> dict[str, Any]:
    if cfg["clip_qkv"] is not None:
        raise cfg.unsupported("clip_qkv", "clamped q/k/v projections", "clip_qkv=None")
    if cfg["head_dim"] is not None and cfg["head_dim"] != fields["d_model"] // fields["n_heads"]:
        raise cfg.unsupported("head_dim", "a head width other than hidden_size // num_attention_heads",
                              f"head_dim={fields['d_model'] // fields['n_heads']}")
    attention = {**fields["options"].get("attention", {}), **QK_NORM, "qk_norm_eps": fields["norm_eps"]}
    fields["ffn"] = "moe"
    fields["d_ff"], ffn = moe_options(cfg, "num_experts", "intermediate_size", cfg.boolean("norm_topk_prob"))
    fields["options"] = {**fields["options"], "attention": attention, "ffn": ffn}
    return fields


@register_converter("olmoe")
def convert_olmoe(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert an ``OlmoeForCausalLM`` checkpoint (per-expert or fused expert tensors).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: as for Llama, ``clip_qkv`` set, or more experts per token than experts.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    n_experts = HFConfig("olmoe", hf_config, DEFAULTS).positive_int("num_experts")
    names = moe_names(n_experts, "mlp", PLAIN_EXPERT)
    state_dict = unfuse_experts(state_dict, "mlp", PLAIN_EXPERT)
    return convert_llama_like("olmoe", hf_config, state_dict, DEFAULTS, _olmoe_fields, names=names)


@register_exporter("olmoe")
def export_olmoe(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """An ``OlmoeForCausalLM`` config and per-expert state dict for an OLMoE-shaped ``DecoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: no whole-projection RMSNorm q/k norms, windows, per-layer options, a shared expert, biases on
            the experts, or other parts OLMoE lacks.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    moe = model.config.block_options("ffn") if isinstance(model, DecoderLM) else {}

    def extra(c: DecoderLMConfig) -> dict[str, Any]:
        attention = check_attention_options(c, {"qk_norm", "qk_norm_eps", "qk_norm_scope", "bias"})
        require(all(attention.get(k) == v for k, v in QK_NORM.items()) and attention.get("qk_norm_eps") == c.norm_eps,
                "OLMoE has RMSNorm q/k norms over the whole projections with the model's eps")
        require(c.d_head * c.n_heads == c.d_model, f"d_head={c.d_head} (OLMoE's is d_model // n_heads)")
        require(not c.layer_options, "per-layer options (OLMoE's layers are all alike)")
        require(not c.bias, "biases on the experts (OLMoE has none)")
        require(not moe.get("d_shared"), "a shared expert (OLMoE has none)")
        return {"attention_bias": attention.get("bias", False), "clip_qkv": None,
                **export_moe_fields(c, "num_experts", None)}

    config, state = export_llama_like(model, "olmoe", "OlmoeForCausalLM", extra,
                                      names=moe_names(moe.get("n_experts", 8), "mlp", PLAIN_EXPERT), moe=True)
    config.pop("head_dim")  # OlmoeConfig has no head_dim: d_model // n_heads
    return config, state


DecoderLM.register_preset("olmoe-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, n_kv_heads=2, d_ff=32, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary", ffn="moe", norm="rmsnorm", norm_eps=1e-5, sublayer="pre_norm", bias=False,
    tie_embeddings=False, pad_token_id=1, bos_token_id=None, eos_token_id=2,
    options={"attention": {**QK_NORM, "qk_norm_eps": 1e-5},
             "ffn": {"n_experts": 6, "top_k": 3, "renormalize": False}},
))
DecoderLM.register_preset("olmoe-1b-7b-0924", dict(
    vocab_size=50304, d_model=2048, n_heads=16, n_kv_heads=16, d_ff=1024, n_layers=16, max_len=4096, dropout=0.0,
    positional="rotary", ffn="moe", norm="rmsnorm", norm_eps=1e-5, sublayer="pre_norm", bias=False,
    tie_embeddings=False, pad_token_id=1, bos_token_id=None, eos_token_id=50279,
    options={"attention": {**QK_NORM, "qk_norm_eps": 1e-5},
             "ffn": {"n_experts": 64, "top_k": 8, "renormalize": False}},
))
