"""Mixtral (``model_type: mixtral``) <-> ``DecoderLM``: a Mistral whose FFN is the ``moe`` block (top-k softmax router,
renormalised kept weights, SwiGLU experts), and the expert-name machinery the other MoE families share.

Checkpoints on disk (and what ``save_pretrained`` writes) hold one tensor per expert linear
(``block_sparse_moe.experts.<e>.w1``); ``transformers`` 5 keeps the experts fused in memory
(``mlp.experts.gate_up_proj`` ``(E, 2·I, H)``, ``mlp.experts.down_proj`` ``(E, H, I)``), which a state dict taken
from a live model holds: both load. Exports write the per-expert form, which ``transformers`` loads.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import register_exporter, require
from .hf_checkpoint import HFConfig
from .llama import DEFAULTS as LLAMA_DEFAULTS
from .llama import GATED_FFNS, NAMES, check_attention_options, convert_llama_like, export_llama_like
from .mistral import mistral_fields
from .name_maps import NameMap
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# MixtralConfig's defaults in transformers 5.
DEFAULTS: dict[str, Any] = {
    **LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5, "sliding_window": None, "rope_theta": 1e6, "num_experts_per_tok": 2,
    "num_local_experts": 8, "output_router_logits": False, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
}

#: Mixtral's expert linears: zoo name -> checkpoint name.
MIXTRAL_EXPERT = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
#: Qwen-MoE/OLMoE expert linears keep the zoo's names.
PLAIN_EXPERT = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
_DENSE_MLP = re.compile(
    r"(?P<layer>.*layers\.(?P<i>\d+))\.mlp\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>weight|bias)")
_FUSED = re.compile(r"(?P<layer>.*layers\.\d+)\.mlp\.experts\.(?P<part>gate_up_proj|down_proj)")


def moe_names(n_experts: int, prefix: str, expert: Mapping[str, str], shared: bool = False) -> NameMap:
    """Llama's name map with the FFN replaced by a router ``{prefix}.gate``, experts ``{prefix}.experts.<e>.<name>``
    and (``shared``) Qwen2-MoE's ``{prefix}.shared_expert`` (its gate is a row of the router, see ``qwen2_moe``).

    Args:
        n_experts: the number of experts.
        prefix: the MoE block's module (``"block_sparse_moe"``, ``"mlp"``).
        expert: zoo expert linear -> the family's name for it.
        shared: whether the block has a shared expert.

    Returns:
        The zoo -> ``transformers`` name map.
    """
    layer = {k: v for k, v in NAMES.layer.items() if not k.startswith("ffn.")}
    layer["ffn.router"] = f"{prefix}.gate"
    for e in range(n_experts):
        layer.update({f"ffn.experts.{e}.{zoo}": f"{prefix}.experts.{e}.{hf}" for zoo, hf in expert.items()})
    if shared:
        layer.update({f"ffn.shared_expert.{name}": f"{prefix}.shared_expert.{name}" for name in PLAIN_EXPERT})
    return dataclasses.replace(NAMES, layer=layer)


def unfuse_experts(state_dict: Mapping[str, Tensor], prefix: str, expert: Mapping[str, str]) -> Mapping[str, Tensor]:
    """A live ``transformers`` 5 state dict (fused ``mlp.experts.gate_up_proj`` / ``down_proj``, router ``mlp.gate``)
    in the per-expert checkpoint form; a per-expert state dict is returned unchanged.

    Args:
        state_dict: the checkpoint's tensors.
        prefix: the MoE block's module in the per-expert form.
        expert: zoo expert linear (``gate_proj``, ``up_proj``, ``down_proj``) -> the family's name for it.

    Returns:
        The per-expert state dict.

    Shapes: ``gate_up_proj`` ``(E, 2·d_ff, d_model)`` -> gate and up ``(d_ff, d_model)`` per expert;
    ``down_proj`` ``(E, d_model, d_ff)`` -> ``(d_model, d_ff)`` per expert.
    """
    if not any(_FUSED.fullmatch(key) for key in state_dict):
        return state_dict
    out: dict[str, Tensor] = {}
    for key, tensor in state_dict.items():
        match = _FUSED.fullmatch(key)
        if match is None:
            out[re.sub(r"(layers\.\d+)\.mlp\.gate\.", rf"\1.{prefix}.gate.", key)] = tensor
            continue
        base = f"{match['layer']}.{prefix}.experts"
        for e, weight in enumerate(tensor):
            if match["part"] == "down_proj":
                out[f"{base}.{e}.{expert['down_proj']}.weight"] = weight
            else:
                gate, up = weight.chunk(2, dim=0)
                out[f"{base}.{e}.{expert['gate_proj']}.weight"] = gate
                out[f"{base}.{e}.{expert['up_proj']}.weight"] = up
    return out


def dense_layer_options(d_ff: int) -> dict[str, dict[str, Any]]:
    """The per-layer options that make a ``moe`` block a dense FFN of width ``d_ff``: no routed experts, the shared
    expert (ungated) as the MLP. DeepSeek's first ``first_k_dense_replace`` layers and Qwen-MoE's
    ``mlp_only_layers`` are such layers.

    Args:
        d_ff: the dense MLP's width.

    Returns:
        ``layer_options`` entry.
    """
    return {"ffn": {"n_experts": 0, "top_k": 0, "d_shared": d_ff, "shared_gate": False, "aux_loss_coef": 0.0}}


def dense_mlps_as_shared(state_dict: Mapping[str, Tensor], dense: set[int], shared: str) -> dict[str, Tensor]:
    """The state dict with each dense layer's ``mlp.{gate,up,down}_proj`` renamed to its block's shared expert
    ``mlp.<shared>.*`` (how ``dense_layer_options`` holds it).

    Args:
        state_dict: the checkpoint's tensors.
        dense: the dense layers' indices.
        shared: the family's name of the shared expert (``shared_expert``, DeepSeek's ``shared_experts``).

    Returns:
        The renamed state dict (the same tensors).

    Shapes: any tensors.
    """
    out: dict[str, Tensor] = {}
    for key, tensor in state_dict.items():
        match = _DENSE_MLP.fullmatch(key)
        if match and int(match["i"]) in dense:
            key = f"{match['layer']}.mlp.{shared}.{match['proj']}.{match['kind']}"
        out[key] = tensor
    return out


def sparse_step_layers(cfg: HFConfig, n_layers: int) -> set[int]:
    """The dense (MLP-only) layers of a Qwen-MoE config, as ``transformers`` chooses them: those in
    ``mlp_only_layers``, and those ``decoder_sparse_step`` skips (layer ``i`` is MoE when ``(i + 1) % step == 0``).

    Args:
        cfg: the checkpoint's config.
        n_layers: its layer count.

    Returns:
        The dense layers' indices.

    Raises:
        ValueError: ``mlp_only_layers`` not a list of layer indices, or ``decoder_sparse_step`` not a positive integer.
    """
    listed = cfg["mlp_only_layers"] or []
    if not isinstance(listed, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in listed
    ):
        raise cfg.unsupported("mlp_only_layers", "the dense layers", f"a list of layer indices in [0, {n_layers})")
    step = cfg.positive_int("decoder_sparse_step")
    return set(listed) | {i for i in range(n_layers) if (i + 1) % step}


def moe_options(cfg: HFConfig, experts_key: str, width_key: str, renormalize: bool) -> tuple[int, dict[str, Any]]:
    """``(d_ff, ffn options)`` of a checkpoint's MoE block: experts, top-k, the expert FFN from ``hidden_act``,
    and the load-balancing coefficient (``router_aux_loss_coef`` where ``output_router_logits`` adds it to the loss
    in ``transformers``, else 0).

    Args:
        cfg: the checkpoint's config.
        experts_key: the field holding the number of experts.
        width_key: the field holding an expert's FFN width.
        renormalize: whether the kept top-k weights are renormalised to sum to 1.

    Returns:
        ``(d_ff, ffn options)``.

    Raises:
        ValueError: ``num_experts_per_tok`` larger than the number of experts, or non-positive sizes.
    """
    n_experts, top_k = cfg.positive_int(experts_key), cfg.positive_int("num_experts_per_tok")
    if top_k > n_experts:
        raise cfg.unsupported("num_experts_per_tok", f"experts per token out of {experts_key}={n_experts}",
                              f"num_experts_per_tok <= {n_experts}")
    coef = float(cfg["router_aux_loss_coef"]) if cfg["output_router_logits"] else 0.0
    options = {"n_experts": n_experts, "top_k": top_k, "renormalize": renormalize,
               "expert": GATED_FFNS[cfg["hidden_act"]], "aux_loss_coef": coef}
    return cfg.positive_int(width_key), options


def export_moe_fields(c: DecoderLMConfig, experts_key: str, renormalize: bool | None) -> dict[str, Any]:
    """The MoE fields of an export (``renormalize``: the value the family fixes, or None for ``norm_topk_prob``).

    Args:
        c: the zoo model's config.
        experts_key: the field to write the number of experts to.
        renormalize: the value the family fixes, or None to write it as ``norm_topk_prob``.

    Returns:
        The ``config.json`` fields.

    Raises:
        NotExportable: per-layer FFN options, a shared expert, a router or renormalisation the family lacks.
    """
    moe = c.block_options("ffn")
    require(not any("ffn" in entry for entry in c.layer_options), "per-layer ffn options")
    require(moe.get("router", "softmax") == "softmax", f"router={moe.get('router')!r} (only 'softmax')")
    renorm = moe.get("renormalize", True)
    fields: dict[str, Any] = {
        experts_key: moe.get("n_experts", 8), "num_experts_per_tok": moe.get("top_k", 2),
        "output_router_logits": bool(moe.get("aux_loss_coef", 0.0)),
        "router_aux_loss_coef": moe.get("aux_loss_coef") or DEFAULTS["router_aux_loss_coef"],
    }
    require(not moe.get("z_loss_coef"), "a router z-loss (transformers has none)")
    if renormalize is None:
        fields["norm_topk_prob"] = renorm
    else:
        require(renorm == renormalize, f"renormalize={renorm} (the family fixes {renormalize})")
    return fields


def _mixtral_fields(cfg: HFConfig, fields: dict[str, Any]) -> dict[str, Any]:
    fields = mistral_fields(cfg, fields)
    cfg.warn_training_only("router_jitter_noise", 0.0, "router jitter")
    fields["ffn"] = "moe"
    fields["d_ff"], fields["options"]["ffn"] = moe_options(cfg, "num_local_experts", "intermediate_size", True)
    return fields


@register_converter("mixtral")
def convert_mixtral(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``MixtralForCausalLM`` checkpoint (per-expert or fused expert tensors).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: as for Mistral, or more experts per token than experts.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    cfg = HFConfig("mixtral", hf_config, DEFAULTS)
    names = moe_names(cfg.positive_int("num_local_experts"), "block_sparse_moe", MIXTRAL_EXPERT)
    state_dict = unfuse_experts(state_dict, "block_sparse_moe", MIXTRAL_EXPERT)
    return convert_llama_like("mixtral", hf_config, state_dict, DEFAULTS, _mixtral_fields, names=names)


@register_exporter("mixtral")
def export_mixtral(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``MixtralForCausalLM`` config and per-expert state dict for a Mixtral-shaped ``DecoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: biases, per-layer options, a shared expert, no renormalisation, or other parts Mixtral lacks.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    moe = model.config.block_options("ffn") if isinstance(model, DecoderLM) else {}

    def extra(c: DecoderLMConfig) -> dict[str, Any]:
        attention = check_attention_options(c, {"window"})
        require(not c.layer_options, "per-layer options (Mixtral's layers are all alike)")
        require(not c.bias, "bias=True (Mixtral has no biases)")
        require(not moe.get("d_shared"), "a shared expert (Mixtral has none)")
        return {"sliding_window": attention.get("window"), **export_moe_fields(c, "num_local_experts", True)}

    names = moe_names(moe.get("n_experts", 8), "block_sparse_moe", MIXTRAL_EXPERT)
    return export_llama_like(model, "mixtral", "MixtralForCausalLM", extra, names=names, moe=True)


DecoderLM.register_preset("mixtral-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary", ffn="moe", norm="rmsnorm", norm_eps=1e-5, sublayer="pre_norm", bias=False,
    tie_embeddings=False, pad_token_id=None, bos_token_id=1, eos_token_id=2,
    options={"positional": {"base": 1e6}, "ffn": {"n_experts": 5, "top_k": 2, "aux_loss_coef": 0.02}},
))
DecoderLM.register_preset("mixtral-8x7b-v0.1", dict(
    vocab_size=32000, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, n_layers=32, max_len=32768, dropout=0.0,
    positional="rotary", ffn="moe", norm="rmsnorm", norm_eps=1e-5, sublayer="pre_norm", bias=False,
    tie_embeddings=False, pad_token_id=None, bos_token_id=1, eos_token_id=2,
    options={"positional": {"base": 1e6}, "ffn": {"n_experts": 8, "top_k": 2}},
))

# The task classes: score on the last real token, a token classifier, qa_outputs.
register_tasks(TaskLayout("mixtral", "model.", decoder_classes("model.", "model.", stem="Mixtral")))
