"""GPT-2 (``model_type: gpt2``) <-> ``DecoderLM``.

GPT-2 stores its projections as ``Conv1D`` modules, whose weight is ``(in, out)`` — the transpose of an
``nn.Linear`` weight — and fuses the query, key and value projections into one ``c_attn`` of width
``3 · d_model``; the converter transposes and splits them. Everything else maps one to one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import activation_name, register_exporter, require, require_plain_attention, tensors
from .hf_checkpoint import CheckpointReader, HFConfig, zoo_config
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# GPT2Config's defaults in transformers 5 (fields a config.json may leave out).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
    "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False, "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256,
    "pad_token_id": None,
}
# GPT2Config.attribute_map: generic names transformers accepts for GPT-2's own.
ALIASES = {"n_embd": "hidden_size", "n_positions": "max_position_embeddings", "n_head": "num_attention_heads",
           "n_layer": "num_hidden_layers"}

# transformers' Conv1D modules of a block (other than the fused c_attn) -> zoo linear layers.
CONV1D_NAMES = {"attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "ffn.up_proj", "mlp.c_proj": "ffn.down_proj"}


@register_converter("gpt2")
def convert_gpt2(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``GPT2LMHeadModel`` (or ``GPT2Model``) checkpoint.

    ``reorder_and_upcast_attn`` changes only the order of fp32 operations and is accepted; the dropout of
    the embeddings is approximated by the residual dropout (training only, with a warning if they differ).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: ``scale_attn_weights=False``, ``scale_attn_by_inverse_layer_idx=True``,
            ``add_cross_attention=True``, an activation no zoo FFN computes, or a checkpoint that does not
            match its config.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    cfg = HFConfig("gpt2", hf_config, DEFAULTS, ALIASES)
    cfg.require("scale_attn_weights", [True], "attention scores scaled by 1/sqrt(d_head) or not")
    cfg.require("scale_attn_by_inverse_layer_idx", [False], "attention scores also divided by layer index + 1")
    cfg.require("add_cross_attention", [False], "cross-attention blocks in a decoder-only model")
    d_model = cfg.positive_int("n_embd")
    n_layers = cfg.positive_int("n_layer")
    d_ff = d_model * 4 if cfg["n_inner"] is None else cfg.positive_int("n_inner")
    cfg.warn_training_only("embd_pdrop", cfg.probability("resid_pdrop"), "dropout on the embeddings")
    config = zoo_config(
        "gpt2", DecoderLMConfig,
        vocab_size=cfg.positive_int("vocab_size"), d_model=d_model, n_heads=cfg.positive_int("n_head"), d_ff=d_ff,
        n_layers=n_layers, max_len=cfg.positive_int("n_positions"), dropout=cfg.probability("resid_pdrop"),
        attention_dropout=cfg.probability("attn_pdrop"), positional="learned",
        ffn=cfg.activation("activation_function"), norm="layernorm", norm_eps=float(cfg["layer_norm_epsilon"]),
        sublayer="pre_norm", bias=True, tie_embeddings=bool(cfg["tie_word_embeddings"]),
        **cfg.token_ids("pad_token_id", "bos_token_id", "eos_token_id"),
    )

    # attn.bias / attn.masked_bias are causal-mask buffers older versions saved.
    ckpt = CheckpointReader("gpt2", state_dict, prefix="transformer.", ignore=[r"h\.\d+\.attn\.(masked_)?bias"])
    ckpt.drop(r"multiple_choice_head\..*", "GPT2DoubleHeadsModel's multiple-choice head")
    out: dict[str, Tensor] = {
        "embed_tokens.weight": ckpt.take("wte.weight"),
        "positional.weight": ckpt.take("wpe.weight"),
        "final_norm.weight": ckpt.take("ln_f.weight"),
        "final_norm.bias": ckpt.take("ln_f.bias"),
    }
    for i in range(n_layers):
        src, dst = f"h.{i}.", f"layers.{i}."
        # Conv1D: y = x @ W + b with W (in, out); c_attn's output is [q | k | v].
        qkv_w, qkv_b = ckpt.take(src + "attn.c_attn.weight"), ckpt.take(src + "attn.c_attn.bias")
        if qkv_w.dim() != 2 or qkv_w.shape[1] != 3 * d_model:
            raise ValueError(f"gpt2 {src}attn.c_attn.weight must be (n_embd, 3·n_embd), got {tuple(qkv_w.shape)}")
        for name, w, b in zip(("q", "k", "v"), qkv_w.split(d_model, dim=1), qkv_b.split(d_model), strict=True):
            out[f"{dst}self_attn.{name}_proj.weight"] = w.t().contiguous()
            out[f"{dst}self_attn.{name}_proj.bias"] = b.contiguous()
        for hf, zoo in CONV1D_NAMES.items():
            out[f"{dst}{zoo}.weight"] = ckpt.take(f"{src}{hf}.weight").t().contiguous()
            out[f"{dst}{zoo}.bias"] = ckpt.take(f"{src}{hf}.bias")
        for hf, zoo in (("ln_1", "self_attn_sublayer.norm"), ("ln_2", "ffn_sublayer.norm")):
            out[f"{dst}{zoo}.weight"] = ckpt.take(f"{src}{hf}.weight")
            out[f"{dst}{zoo}.bias"] = ckpt.take(f"{src}{hf}.bias")

    allow_missing: frozenset[str] = frozenset()
    if config.tie_embeddings:
        ckpt.skip("lm_head.weight")  # the tied copy some versions save; the model reads wte
    elif ckpt.has("lm_head.weight"):
        out["lm_head.weight"] = ckpt.take("lm_head.weight")
    else:
        allow_missing = frozenset({"lm_head.weight"})  # a GPT2Model checkpoint with an untied head
    ckpt.finish()
    return Converted(DecoderLM, config, out, allow_missing)


@register_exporter("gpt2")
def export_gpt2(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``GPT2LMHeadModel`` config and state dict for a GPT-2-shaped ``DecoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: not a ``DecoderLM``, or one with parts GPT-2 lacks (non-learned positions, a
            post-norm stack, GQA, RMSNorm, gated FFNs, no biases).

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    require(isinstance(model, DecoderLM), f"{type(model).__name__} is not a DecoderLM")
    c = model.config
    require(c.positional == "learned", f"positional={c.positional!r} (only 'learned')")
    require(c.sublayer == "pre_norm", f"sublayer={c.sublayer!r} (only 'pre_norm')")
    require_plain_attention(c)
    config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": c.vocab_size,
        "n_positions": c.max_len, "n_embd": c.d_model, "n_layer": c.n_layers, "n_head": c.n_heads,
        "n_inner": c.d_ff, "activation_function": activation_name(c), "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout, "attn_pdrop": c.attention_dropout, "layer_norm_epsilon": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings, "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
    }
    zoo = tensors(model)
    out = {
        "transformer.wte.weight": zoo["embed_tokens.weight"],
        "transformer.wpe.weight": zoo["positional.weight"],
        "transformer.ln_f.weight": zoo["final_norm.weight"],
        "transformer.ln_f.bias": zoo["final_norm.bias"],
    }
    for i in range(c.n_layers):
        src, dst = f"layers.{i}.", f"transformer.h.{i}."
        attn = [src + f"self_attn.{n}_proj" for n in ("q", "k", "v")]
        out[dst + "attn.c_attn.weight"] = torch.cat([zoo[a + ".weight"] for a in attn]).t()
        out[dst + "attn.c_attn.bias"] = torch.cat([zoo[a + ".bias"] for a in attn])
        for hf, name in CONV1D_NAMES.items():
            out[f"{dst}{hf}.weight"] = zoo[f"{src}{name}.weight"].t()
            out[f"{dst}{hf}.bias"] = zoo[f"{src}{name}.bias"]
        for hf, name in (("ln_1", "self_attn_sublayer.norm"), ("ln_2", "ffn_sublayer.norm")):
            out[f"{dst}{hf}.weight"] = zoo[f"{src}{name}.weight"]
            out[f"{dst}{hf}.bias"] = zoo[f"{src}{name}.bias"]
    if not c.tie_embeddings:
        out["lm_head.weight"] = zoo["lm_head.weight"]
    return config, out


# The published size (the tiny test size is DecoderLM's own "tiny" preset).
DecoderLM.register_preset("gpt2-small", dict(
    vocab_size=50257, d_model=768, n_heads=12, d_ff=3072, n_layers=12, max_len=1024, dropout=0.1,
    attention_dropout=0.1, ffn="gelu_tanh", norm_eps=1e-5, pad_token_id=None,
    bos_token_id=50256, eos_token_id=50256,
))

# The task classes: score on the last real token, a token classifier, qa_outputs.
register_tasks(TaskLayout("gpt2", "transformer.", decoder_classes(
    "transformer.", "transformer.", token_names="classifier", stem="GPT2")))
