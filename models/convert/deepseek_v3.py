"""DeepSeek-V3 (``model_type: deepseek_v3``) <-> ``DecoderLM``: DeepSeek-V2's layout (``deepseek_v2``: latent attention,
shared experts, dense first layers) with DeepSeek-V3's router (``sigmoid_group``): sigmoid scores plus the
checkpoint's ``e_score_correction_bias`` choose the experts among the ``topk_group`` best of ``n_group`` groups (a
group scores the sum of its two best biased scores), the unbiased scores weigh them, renormalised when
``norm_topk_prob``, times ``routed_scaling_factor``. ``rope_interleave`` picks the rotary layout."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .deepseek_v2 import DEFAULTS as V2_DEFAULTS
from .deepseek_v2 import convert_deepseek_like, deepseek_fields, export_deepseek_like, rotary_fraction
from .export import register_exporter, require
from .hf_checkpoint import HFConfig
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# DeepseekV3Config's defaults in transformers 5.
DEFAULTS: dict[str, Any] = {
    **V2_DEFAULTS, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "q_lora_rank": 1536,
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1, "rope_interleave": True,
}


def _v3_fields(cfg: HFConfig) -> dict[str, Any]:
    router = {"router": "sigmoid_group", "n_group": cfg.positive_int("n_group"),
              "topk_group": cfg.positive_int("topk_group"), "renormalize": cfg.boolean("norm_topk_prob"),
              "routed_scaling_factor": float(cfg["routed_scaling_factor"])}
    return deepseek_fields(cfg, router, interleaved=bool(cfg["rope_interleave"]))


@register_converter("deepseek_v3")
def convert_deepseek_v3(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``DeepseekV3ForCausalLM`` checkpoint (per-expert or fused expert tensors; the multi-token-prediction
    layers some checkpoints carry past ``num_hidden_layers`` are refused by name, as unused tensors).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: ``n_group`` not dividing the experts, ``topk_group > n_group``, or as
            ``deepseek_v2.deepseek_fields`` (the field named).

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    return convert_deepseek_like("deepseek_v3", hf_config, state_dict, DEFAULTS, _v3_fields)


@register_exporter("deepseek_v3")
def export_deepseek_v3(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``DeepseekV3ForCausalLM`` config and per-expert state dict for a DeepSeek-V3-shaped ``DecoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: a router other than ``sigmoid_group``, or parts DeepSeek lacks.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """

    def extra(c: DecoderLMConfig, ffn: dict[str, Any]) -> dict[str, Any]:
        require(ffn.get("router") == "sigmoid_group", f"router={ffn.get('router')!r} (DeepSeek-V3: 'sigmoid_group')")
        return {"n_group": ffn.get("n_group", 1), "topk_group": ffn.get("topk_group", 1),
                "norm_topk_prob": bool(ffn.get("renormalize", True)),
                "rope_interleave": c.positional == "rotary_interleaved"}

    return export_deepseek_like(model, "deepseek_v3", "DeepseekV3ForCausalLM", extra)


DecoderLM.register_preset("deepseek_v3-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, d_head=20, d_value=12, d_ff=16, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary_interleaved", ffn="moe", attention="mla", norm="rmsnorm", norm_eps=1e-6,
    sublayer="pre_norm", bias=False, tie_embeddings=False, pad_token_id=None, bos_token_id=0, eos_token_id=1,
    options={"positional": {"base": 10000.0, "fraction": rotary_fraction(8, 20)},
             "attention": {"kv_lora_rank": 24, "q_lora_rank": 40, "d_rope": 8},
             "ffn": {"n_experts": 8, "top_k": 3, "router": "sigmoid_group", "n_group": 4, "topk_group": 2,
                     "renormalize": True, "routed_scaling_factor": 2.5, "d_shared": 16}},
    layer_options=({"ffn": {"n_experts": 0, "top_k": 0, "d_shared": 80}}, {}),
))
# DeepSeek-V3 (671B total, 37B active; DeepSeek-R1 has the same shape).
DecoderLM.register_preset("deepseek-v3", dict(
    vocab_size=129280, d_model=7168, n_heads=128, d_head=192, d_value=128, d_ff=2048, n_layers=61, max_len=163840,
    dropout=0.0, positional="rotary_interleaved", ffn="moe", attention="mla", norm="rmsnorm", norm_eps=1e-6,
    sublayer="pre_norm", bias=False, tie_embeddings=False, pad_token_id=None, bos_token_id=0, eos_token_id=1,
    options={"positional": {"base": 10000.0, "fraction": rotary_fraction(64, 192), "scaling": {
        "type": "yarn", "factor": 40.0, "original_max_len": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}},
        "attention": {"kv_lora_rank": 512, "q_lora_rank": 1536, "d_rope": 64,
                      "scale": 192 ** -0.5 * (0.1 * math.log(40.0) + 1.0) ** 2},
        "ffn": {"n_experts": 256, "top_k": 8, "router": "sigmoid_group", "n_group": 8, "topk_group": 4,
                "renormalize": True, "routed_scaling_factor": 2.5, "d_shared": 2048}},
    layer_options=(*({"ffn": {"n_experts": 0, "top_k": 0, "d_shared": 18432}},) * 3, *({},) * 58),
))

# The task classes: score on the last real token and a token classifier (no question answering in transformers).
register_tasks(TaskLayout("deepseek_v3", "model.", decoder_classes("model.", None, stem="DeepseekV3")))
