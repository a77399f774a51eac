"""Phi-3 (``model_type: phi3``) <-> ``DecoderLM``: a Llama without biases whose checkpoint fuses projections.

``qkv_proj`` holds the rows ``[q; k; v]`` (``n_heads · head_dim`` query rows, then ``n_kv_heads · head_dim`` key
and value rows) and ``gate_up_proj`` the rows ``[gate; up]``; the converter splits them into the zoo's separate
projections and the exporter fuses them back. ``partial_rotary_factor`` becomes the rotary option ``fraction`` and
``sliding_window`` (every layer) the attention option ``window``. The long-context RoPE of Phi-3 128k models
(``longrope``, older files ``su``/``yarn``) becomes the rotary scaling ``longrope``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import register_exporter, require
from .hf_checkpoint import CheckpointReader, HFConfig, zoo_config
from .llama import DEFAULTS as LLAMA_DEFAULTS
from .llama import NAMES, check_attention_options, export_llama_like, llama_fields
from .name_maps import read_mapped
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# Phi3Config's defaults in transformers 5 (Phi-3-mini's shape).
DEFAULTS: dict[str, Any] = {
    **LLAMA_DEFAULTS, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
    "attention_dropout": 0.0, "hidden_act": "silu", "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000, "sliding_window": None,
    "attention_bias": False, "mlp_bias": False,
}


def _phi3_fields(cfg: HFConfig) -> dict[str, Any]:
    # As Phi3Config reads them: rope_scaling (older files) replaces rope_parameters, it is not merged into it.
    parameters = dict(cfg.data.get("rope_scaling") or cfg.data.get("rope_parameters") or {})
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind in ("su", "yarn"):  # Phi3Config's older names of longrope
        parameters["rope_type"] = kind = "longrope"
    if kind not in ("default", "longrope"):
        raise ValueError(f"phi3 checkpoint has rope_type={kind!r}; Phi-3 uses the default RoPE or 'longrope'")
    rotary = cfg.rope_options(10000.0, parameters)
    fields = llama_fields(cfg)
    # Phi-3 has no biases at all (transformers ignores attention_bias/mlp_bias in its config).
    fields["bias"] = False
    options: dict[str, dict[str, Any]] = {"positional": rotary}
    window = cfg["sliding_window"]
    if window is not None:
        options["attention"] = {"window": cfg.positive_int("sliding_window")}
    fields["options"] = options
    # resid_pdrop acts after attention and after the MLP, as the zoo's dropout does; embd_pdrop is approximated.
    fields["dropout"] = cfg.probability("resid_pdrop")
    cfg.warn_training_only("embd_pdrop", fields["dropout"], "dropout on the embeddings")
    return fields


def _split_rows(fused: Tensor, sizes: list[int], key: str) -> tuple[Tensor, ...]:
    if fused.dim() != 2 or fused.shape[0] != sum(sizes):
        raise ValueError(f"phi3 {key} must have {sum(sizes)} rows ({' + '.join(map(str, sizes))}), "
                         f"got shape {tuple(fused.shape)}")
    return tuple(part.contiguous() for part in fused.split(sizes))


@register_converter("phi3")
def convert_phi3(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``Phi3ForCausalLM`` checkpoint (Phi-3 and Phi-3.5 mini/medium with the default RoPE).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: RoPE scaling other than ``longrope`` (named), an activation without a gated zoo FFN, a bad
            ``sliding_window``, or weights that do not fit the config.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    cfg = HFConfig("phi3", hf_config, DEFAULTS)
    config = zoo_config("phi3", DecoderLMConfig, **_phi3_fields(cfg))
    ckpt = CheckpointReader("phi3", state_dict, ignore=[r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"])
    fused = tuple(f"layers.{i}.{p}.weight" for i in range(config.n_layers)
                  for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "ffn.gate_proj", "ffn.up_proj"))
    tied = config.tie_embeddings
    out = read_mapped(ckpt, NAMES, DecoderLM, config, skip=fused + (("lm_head.weight",) if tied else ()))
    q_rows, kv_rows = config.n_heads * config.d_head, config.n_kv_heads * config.d_head
    for i in range(config.n_layers):
        key = f"model.layers.{i}.self_attn.qkv_proj.weight"
        q, k, v = _split_rows(ckpt.take(key), [q_rows, kv_rows, kv_rows], key)
        out.update({f"layers.{i}.self_attn.q_proj.weight": q, f"layers.{i}.self_attn.k_proj.weight": k,
                    f"layers.{i}.self_attn.v_proj.weight": v})
        key = f"model.layers.{i}.mlp.gate_up_proj.weight"
        gate, up = _split_rows(ckpt.take(key), [config.d_ff, config.d_ff], key)
        out.update({f"layers.{i}.ffn.gate_proj.weight": gate, f"layers.{i}.ffn.up_proj.weight": up})
    if tied:
        ckpt.skip("lm_head.weight")  # the tied copy some versions save
    ckpt.finish()
    return Converted(DecoderLM, config, out)


@register_exporter("phi3")
def export_phi3(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``Phi3ForCausalLM`` config and state dict for a Phi-3-shaped ``DecoderLM`` (fused ``qkv_proj`` and
    ``gate_up_proj``).

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: biases, RoPE scaling other than longrope, per-layer windows, or other parts Phi-3 lacks,
            named.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """

    def extra(c: DecoderLMConfig) -> dict[str, Any]:
        attention = check_attention_options(c, {"window"})
        require(not c.layer_options, "per-layer options (Phi-3's layers are all alike)")
        require(not c.bias, "bias=True (Phi-3 has no biases)")
        scaling = c.block_options("positional").get("scaling")
        require(scaling is None or scaling["type"] == "longrope", "RoPE scaling other than longrope")
        original = c.max_len if scaling is None else scaling["original_max_len"]
        return {"sliding_window": attention.get("window"), "resid_pdrop": c.dropout, "embd_pdrop": c.dropout,
                "original_max_position_embeddings": original}

    config, state = export_llama_like(model, "phi3", "Phi3ForCausalLM", extra)
    for key in [k for k in state if k.endswith("self_attn.q_proj.weight")]:
        prefix = key.removesuffix("q_proj.weight")
        state[prefix + "qkv_proj.weight"] = torch.cat([state.pop(f"{prefix}{p}_proj.weight") for p in "qkv"])
    for key in [k for k in state if k.endswith("mlp.gate_proj.weight")]:
        prefix = key.removesuffix("gate_proj.weight")
        state[prefix + "gate_up_proj.weight"] = torch.cat([state.pop(prefix + "gate_proj.weight"),
                                                           state.pop(prefix + "up_proj.weight")])
    return config, state


# A tiny Phi-3 for tests (GQA, a window shorter than test sequences, untied) and Phi-3-mini-4k's published shape.
DecoderLM.register_preset("phi3-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary", ffn="swiglu", norm="rmsnorm", norm_eps=1e-5, sublayer="pre_norm", bias=False,
    tie_embeddings=False, pad_token_id=None, bos_token_id=1, eos_token_id=2,
    options={"positional": {"base": 10000.0}, "attention": {"window": 8}},
))
DecoderLM.register_preset("phi-3-mini-4k", dict(
    vocab_size=32064, d_model=3072, n_heads=32, d_ff=8192, n_layers=32, max_len=4096, dropout=0.0,
    positional="rotary", ffn="swiglu", norm="rmsnorm", norm_eps=1e-5, sublayer="pre_norm", bias=False,
    tie_embeddings=False, pad_token_id=32000, bos_token_id=1, eos_token_id=32000,
    options={"positional": {"base": 10000.0}, "attention": {"window": 2047}},
))

# The task classes: score on the last real token, a token classifier.
register_tasks(TaskLayout("phi3", "model.", decoder_classes("model.", None, stem="Phi3")))
