"""Qwen3-MoE (``model_type: qwen3_moe``) <-> ``DecoderLM``: a Qwen3 (per-head q/k RMSNorm) whose FFN is the ``moe``
block (softmax top-k router, kept weights renormalised when ``norm_topk_prob``, SwiGLU experts of width
``moe_intermediate_size``). Dense layers (``mlp_only_layers``, ``decoder_sparse_step``) load as a per-layer choice:
``moe`` blocks without routed experts whose shared expert is the ``intermediate_size`` MLP (exports of such models
are refused: the exporter writes only all-MoE configs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import register_exporter, require
from .hf_checkpoint import HFConfig
from .llama import DEFAULTS as LLAMA_DEFAULTS
from .llama import check_attention_options, convert_llama_like, export_llama_like
from .mixtral import (
    PLAIN_EXPERT,
    dense_layer_options,
    dense_mlps_as_shared,
    export_moe_fields,
    moe_names,
    moe_options,
    sparse_step_layers,
    unfuse_experts,
)
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# Qwen3MoeConfig's defaults in transformers 5.
DEFAULTS: dict[str, Any] = {
    **LLAMA_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "rope_theta": 10000.0,
    "use_sliding_window": False, "sliding_window": 4096, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
    "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False, "output_router_logits": False,
    "router_aux_loss_coef": 0.001, "mlp_only_layers": [],
}


def dense_layers_of(cfg: HFConfig, fields: dict[str, Any], width_key: str = "intermediate_size") -> dict[str, Any]:
    """``fields`` with the per-layer options of the checkpoint's dense layers (``mlp_only_layers``,
    ``decoder_sparse_step``): a ``moe`` block without routed experts whose shared expert is the ``width_key`` MLP.

    Args:
        cfg: the checkpoint's config.
        fields: the ``DecoderLMConfig`` fields so far (``n_layers`` set; ``layer_options`` kept and merged).
        width_key: the dense MLP's width field.

    Returns:
        ``fields`` with ``layer_options``.
    """
    n_layers = fields["n_layers"]
    dense = sparse_step_layers(cfg, n_layers)
    if dense:
        options = dense_layer_options(cfg.positive_int(width_key))
        given = tuple(fields.get("layer_options") or ({},) * n_layers)  # e.g. sliding windows: kept
        fields["layer_options"] = tuple({**given[i], **options} if i in dense else given[i] for i in range(n_layers))
    return fields


def dense_of(hf_config: Mapping[str, Any], defaults: Mapping[str, Any], model_type: str) -> set[int]:
    """The dense layers of a Qwen-MoE config (checked as ``sparse_step_layers`` checks them).

    Args:
        hf_config: the checkpoint's ``config.json``.
        defaults: the family's defaults.
        model_type: the family, for messages.

    Returns:
        The dense layers' indices.
    """
    cfg = HFConfig(model_type, hf_config, defaults)
    return sparse_step_layers(cfg, cfg.positive_int("num_hidden_layers"))


def with_num_experts(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The config with ``num_experts`` set (transformers 5 writes ``num_local_experts`` for some Qwen-MoE).

    Args:
        hf_config: the checkpoint's ``config.json``.

    Returns:
        A copy, with ``num_experts`` from ``num_local_experts`` when only that is given.
    """
    data = dict(hf_config)
    if "num_experts" not in data and "num_local_experts" in data:
        data["num_experts"] = data["num_local_experts"]
    return data


def _qwen3_moe_fields(cfg: HFConfig, fields: dict[str, Any]) -> dict[str, Any]:
    attention = {**fields["options"].get("attention", {}), "qk_norm": "rmsnorm", "qk_norm_eps": fields["norm_eps"]}
    if cfg["use_sliding_window"] and cfg["sliding_window"] is not None:
        attention["window"] = cfg.positive_int("sliding_window")
    fields["ffn"] = "moe"
    fields["d_ff"], ffn = moe_options(cfg, "num_experts", "moe_intermediate_size", cfg.boolean("norm_topk_prob"))
    fields["options"] = {**fields["options"], "attention": attention, "ffn": ffn}
    return dense_layers_of(cfg, fields)


@register_converter("qwen3_moe")
def convert_qwen3_moe(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``Qwen3MoeForCausalLM`` checkpoint (per-expert or fused expert tensors).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: as for Llama, ``mlp_only_layers`` that are not layer indices, or more experts per token than
            experts. Dense layers (``mlp_only_layers``, ``decoder_sparse_step``) are ``moe`` blocks without routed
            experts whose shared expert is the MLP (``dense_layer_options``), as DeepSeek's first layers are.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    hf_config = with_num_experts(hf_config)
    dense = dense_of(hf_config, DEFAULTS, "qwen3_moe")
    names = moe_names(HFConfig("qwen3_moe", hf_config, DEFAULTS).positive_int("num_experts"), "mlp", PLAIN_EXPERT,
                      shared=bool(dense))
    state_dict = dense_mlps_as_shared(unfuse_experts(state_dict, "mlp", PLAIN_EXPERT), dense, "shared_expert")
    return convert_llama_like("qwen3_moe", hf_config, state_dict, DEFAULTS, _qwen3_moe_fields, names=names)


@register_exporter("qwen3_moe")
def export_qwen3_moe(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``Qwen3MoeForCausalLM`` config and per-expert state dict for a Qwen3-MoE-shaped ``DecoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: no RMSNorm q/k norms, per-layer options, a shared expert, or other parts Qwen3-MoE lacks.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    moe = model.config.block_options("ffn") if isinstance(model, DecoderLM) else {}

    def extra(c: DecoderLMConfig) -> dict[str, Any]:
        attention = check_attention_options(c, {"qk_norm", "qk_norm_eps", "bias", "window"})
        require(attention.get("qk_norm") == "rmsnorm" and attention.get("qk_norm_eps") == c.norm_eps,
                "Qwen3-MoE has RMSNorm q/k norms with the model's eps")
        require(not c.layer_options, "per-layer options (Qwen3-MoE's layers are all alike)")
        require(not c.bias, "biases on the experts (Qwen3-MoE has none)")
        require(not moe.get("d_shared"), "a shared expert (Qwen3-MoE has none)")
        window = attention.get("window")
        return {"attention_bias": attention.get("bias", False), "moe_intermediate_size": c.d_ff,
                "use_sliding_window": window is not None, "sliding_window": window, "decoder_sparse_step": 1,
                "mlp_only_layers": [], **export_moe_fields(c, "num_experts", None)}

    names = moe_names(moe.get("n_experts", 8), "mlp", PLAIN_EXPERT)
    return export_llama_like(model, "qwen3_moe", "Qwen3MoeForCausalLM", extra, names=names, moe=True)


DecoderLM.register_preset("qwen3_moe-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, n_kv_heads=2, d_head=32, d_ff=32, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary", ffn="moe", norm="rmsnorm", norm_eps=1e-6, sublayer="pre_norm", bias=False,
    tie_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=2,
    options={"positional": {"base": 1000000.0}, "attention": {"qk_norm": "rmsnorm", "qk_norm_eps": 1e-6},
             "ffn": {"n_experts": 6, "top_k": 3, "renormalize": True}},
))
DecoderLM.register_preset("qwen3-30b-a3b", dict(
    vocab_size=151936, d_model=2048, n_heads=32, n_kv_heads=4, d_head=128, d_ff=768, n_layers=48, max_len=40960,
    dropout=0.0, positional="rotary", ffn="moe", norm="rmsnorm", norm_eps=1e-6, sublayer="pre_norm", bias=False,
    tie_embeddings=False, pad_token_id=None, bos_token_id=151643, eos_token_id=151645,
    options={"positional": {"base": 1000000.0}, "attention": {"qk_norm": "rmsnorm", "qk_norm_eps": 1e-6},
             "ffn": {"n_experts": 128, "top_k": 8, "renormalize": True}},
))

# The task classes: score on the last real token, a token classifier, qa_outputs.
register_tasks(TaskLayout("qwen3_moe", "model.", decoder_classes("model.", "transformer.", stem="Qwen3Moe")))
