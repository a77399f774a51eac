"""ModernBERT (``model_type: modernbert``) <-> ``EncoderLM``.

ModernBERT is a pre-norm ``EncoderLM`` with rotary positions and no absolute position table:

- token embeddings -> LayerNorm (no bias by default: norm option ``bias=False``) -> layers -> ``final_norm``;
- layer 0 has no attention norm (its input was just normalised): layer option ``attention_norm="identity"``;
- attention with fused ``Wqkv`` (rows q, k, v) and ``Wo``; global layers rotate with ``global_rope_theta``
  (160000), local (``sliding_attention``) layers with ``local_rope_theta`` (10000): a per-layer positional ``base``;
- local layers see keys with ``|i - j| <= local_attention // 2``: the zoo's ``window`` (``|i - j| < window``) is
  ``local_attention // 2 + 1``;
- the MLP's ``Wi`` holds ``[input; gate]`` and computes ``Wo(act(input) * gate)``: the zoo's gated FFN computes
  ``down(act(gate_proj(x)) * up_proj(x))``, so ``gate_proj`` is the first half of ``Wi`` and ``up_proj`` the second;
- the MLM head is ``head.dense`` (bias: ``classifier_bias``) -> ``classifier_activation`` -> ``head.norm`` ->
  ``decoder`` (bias: ``decoder_bias``; tied to the embeddings).

Biases: the zoo's ``bias`` is the head's dense bias (``classifier_bias``); ``attention_bias``, ``mlp_bias`` and
``norm_bias`` become attention/FFN/norm options where they differ from it.

Positions: ``transformers`` numbers every column ``0..L-1`` (padding included) and measures the local window in
columns; the zoo counts real tokens. Both agree on right-padded batches (what ModernBERT's tokenizer produces).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..encoder_lm import EncoderLM, EncoderLMConfig
from .export import ACTIVATION_NAMES, register_exporter, require, tensors
from .hf_checkpoint import CheckpointReader, HFConfig, zoo_config
from .llama import GATED_ACTIVATIONS, GATED_FFNS
from .name_maps import NameMap, read_mapped, write_mapped, zoo_keys
from .registry import Converted, register_converter
from .tasks import TaskClass, TaskLayout, register_tasks

# ModernBertConfig's defaults in transformers 5 (fields a config.json may leave out), and the fields of older
# config.json files that transformers 5 still reads (global_attn_every_n_layers, *_rope_theta).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 50368, "hidden_size": 768, "intermediate_size": 1152, "num_hidden_layers": 22,
    "num_attention_heads": 12, "hidden_activation": "gelu", "max_position_embeddings": 8192, "norm_eps": 1e-5,
    "norm_bias": False, "pad_token_id": 50283, "eos_token_id": 50282, "bos_token_id": 50281,
    "mask_token_id": None, "attention_bias": False, "attention_dropout": 0.0, "layer_types": None,
    "local_attention": 128, "embedding_dropout": 0.0, "mlp_bias": False, "mlp_dropout": 0.0, "decoder_bias": True,
    "classifier_bias": False, "classifier_activation": "gelu", "tie_word_embeddings": True,
    "global_attn_every_n_layers": 3, "global_rope_theta": 160000.0, "local_rope_theta": 10000.0,
}

NAMES = NameMap(
    top={
        "embed_tokens": "model.embeddings.tok_embeddings", "embed_norm": "model.embeddings.norm",
        "final_norm": "model.final_norm", "mlm_head.dense": "head.dense", "mlm_head.norm": "head.norm",
        "mlm_head.decoder": "decoder",
    },
    layer={
        "self_attn.o_proj": "attn.Wo", "self_attn_sublayer.norm": "attn_norm", "ffn.down_proj": "mlp.Wo",
        "ffn_sublayer.norm": "mlp_norm",
    },
    stacks={"layers": "model.layers.{i}"},
)
# Zoo tensors stored fused (Wqkv, Wi), per layer.
FUSED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "ffn.gate_proj", "ffn.up_proj")
_FUSED_KEY = re.compile(r"layers\.\d+\.(" + "|".join(re.escape(name) for name in FUSED) + r")\.(weight|bias)")
HEAD = ("mlm_head.dense", "mlm_head.norm", "mlm_head.decoder")


def modernbert_layer_options(
    layer_types: list[str], window: int, global_base: float, local_base: float
) -> tuple[dict[str, Any], ...]:
    """The zoo ``layer_options`` of a ModernBERT stack: no attention norm in layer 0, a window (and, where it differs
    from the global one, the local rotary base) on ``sliding_attention`` layers.

    Args:
        layer_types: ``"full_attention"`` or ``"sliding_attention"`` per layer.
        window: the sliding layers' window.
        global_base: the rotary base of the full-attention layers.
        local_base: the rotary base of the sliding layers.

    Returns:
        One ``layer_options`` entry per layer.
    """
    out = []
    for i, kind in enumerate(layer_types):
        entry: dict[str, Any] = {"layer": {"attention_norm": "identity"}} if i == 0 else {}
        if kind == "sliding_attention":
            entry["attention"] = {"window": window}
            if local_base != global_base:
                entry["positional"] = {"base": local_base}
        out.append(entry)
    return tuple(out)


def _layer_types(cfg: HFConfig, n_layers: int) -> list[str]:
    types = cfg["layer_types"]
    if types is None:  # older config.json files: every n-th layer (from 0) is global
        every = cfg.positive_int("global_attn_every_n_layers")
        types = ["sliding_attention" if i % every else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or set(types) - {"full_attention", "sliding_attention"}:
        raise cfg.unsupported("layer_types", "per-layer attention types",
                              f"a list of {n_layers} entries 'full_attention' or 'sliding_attention'")
    return types


def _rope(cfg: HFConfig, kind: str, old_field: str) -> dict[str, Any]:
    """Rotary options of one layer type from ``rope_parameters[kind]`` (transformers 5) or ``old_field``."""
    entry = dict((cfg.data.get("rope_parameters") or {}).get(kind) or {})
    entry.setdefault("rope_theta", float(cfg[old_field]))
    # transformers applies a top-level rope_scaling to both layer types.
    options = cfg.rope_options(float(cfg[old_field]), {**entry, **(cfg.data.get("rope_scaling") or {})})
    # ModernBERT's rotary always spans the whole head (its frequencies ignore partial_rotary_factor).
    options.pop("fraction", None)
    return options


@register_converter("modernbert")
def convert_modernbert(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``ModernBertForMaskedLM`` or ``ModernBertModel`` checkpoint (a ``ModernBertModel`` gets a freshly
    initialised MLM head, listed in ``allow_missing``).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: an activation with no gated zoo FFN, a head activation other than the exact GELU of the zoo's
            head, unsupported RoPE scaling, rotary settings that differ between layer types in more than the base,
            task heads the zoo lacks, or weights that do not fit the config.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    cfg = HFConfig("modernbert", hf_config, DEFAULTS)
    n_layers = cfg.positive_int("num_hidden_layers")
    d_model, d_ff = cfg.positive_int("hidden_size"), cfg.positive_int("intermediate_size")
    act = cfg["hidden_activation"]
    if act not in GATED_FFNS:
        raise cfg.unsupported("hidden_activation", "the gated MLP's activation",
                              "the activations " + ", ".join(GATED_FFNS))
    types = _layer_types(cfg, n_layers)
    global_rope = _rope(cfg, "full_attention", "global_rope_theta")
    local_rope = _rope(cfg, "sliding_attention", "local_rope_theta")
    if {k: v for k, v in global_rope.items() if k != "base"} != {k: v for k, v in local_rope.items() if k != "base"} \
            and "sliding_attention" in types:
        raise ValueError(
            f"modernbert checkpoint rotates global layers with {global_rope} and local ones with {local_rope}; the zoo "
            "represents layer types that differ only in the rotary base"
        )
    window = cfg.positive_int("local_attention") // 2 + 1  # |i - j| <= local_attention // 2
    classifier_bias = bool(cfg["classifier_bias"])
    options: dict[str, dict[str, Any]] = {"positional": global_rope, "norm": {"bias": bool(cfg["norm_bias"])}}
    if bool(cfg["attention_bias"]) != classifier_bias:
        options["attention"] = {"bias": bool(cfg["attention_bias"])}
    if bool(cfg["mlp_bias"]) != classifier_bias:
        options["ffn"] = {"bias": bool(cfg["mlp_bias"])}
    dropout = cfg.probability("embedding_dropout")
    cfg.warn_training_only("mlp_dropout", dropout, "the dropout inside the MLP")
    config = zoo_config(
        "modernbert", EncoderLMConfig,
        vocab_size=cfg.positive_int("vocab_size"), d_model=d_model, n_heads=cfg.positive_int("num_attention_heads"),
        d_ff=d_ff, n_layers=n_layers, max_len=cfg.positive_int("max_position_embeddings"), dropout=dropout,
        attention_dropout=cfg.probability("attention_dropout"), positional="rotary", ffn=GATED_FFNS[act],
        norm="layernorm", norm_eps=float(cfg["norm_eps"]), sublayer="pre_norm", bias=classifier_bias,
        tie_embeddings=bool(cfg["tie_word_embeddings"]), type_vocab_size=0, options=options,
        layer_options=modernbert_layer_options(types, window, global_rope["base"], local_rope["base"]),
        **cfg.token_ids("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id"),
    )

    # A ModernBertModel checkpoint names its tensors without the task model's "model." prefix.
    state = {k if k.startswith(("model.", "head.", "decoder.")) else f"model.{k}": v for k, v in state_dict.items()}
    ckpt = CheckpointReader("modernbert", state)
    has_head = ckpt.has_prefix("head.")
    decoder_bias = bool(cfg["decoder_bias"])
    if has_head:
        cfg.require("classifier_activation", ["gelu", "gelu_python"], "the activation of the MLM head")
    keys = zoo_keys(EncoderLM, config)
    head = tuple(k for k in keys if k.startswith("mlm_head."))
    skip = tuple(k for k in keys if _FUSED_KEY.fullmatch(k))
    skip += head if not has_head else ("mlm_head.decoder.bias",) if not decoder_bias else ()
    out = read_mapped(ckpt, NAMES, EncoderLM, config, skip=skip)
    for i in range(n_layers):
        prefix = f"model.layers.{i}"
        for p in ("weight", "bias"):
            if f"layers.{i}.self_attn.q_proj.{p}" in keys:
                q, k, v = ckpt.take(f"{prefix}.attn.Wqkv.{p}").chunk(3, dim=0)  # rows: q, k, v
                out.update({f"layers.{i}.self_attn.q_proj.{p}": q, f"layers.{i}.self_attn.k_proj.{p}": k,
                            f"layers.{i}.self_attn.v_proj.{p}": v})
            if f"layers.{i}.ffn.gate_proj.{p}" in keys:
                # Wi = [input; gate] and the MLP computes act(input) * gate: act's argument is the zoo's gate_proj.
                act_in, gate = ckpt.take(f"{prefix}.mlp.Wi.{p}").chunk(2, dim=0)
                out.update({f"layers.{i}.ffn.gate_proj.{p}": act_in, f"layers.{i}.ffn.up_proj.{p}": gate})
    allow_missing: frozenset[str] = frozenset()
    if has_head:
        if config.tie_embeddings:
            ckpt.skip("decoder.weight")  # the word embeddings
        if not decoder_bias:
            out["mlm_head.decoder.bias"] = torch.zeros(config.vocab_size, dtype=out["embed_tokens.weight"].dtype)
    else:
        allow_missing = frozenset(head)
    ckpt.finish()
    return Converted(EncoderLM, config, out, allow_missing)


@register_exporter("modernbert")
def export_modernbert(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``ModernBertForMaskedLM`` config and state dict for a ModernBERT-shaped ``EncoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: not an ``EncoderLM``, or one with parts ModernBERT lacks: non-rotary positions, a non-gated
            FFN, segment embeddings, GQA, an attention norm in layer 0 (or none elsewhere), windows or rotary bases
            that differ between local layers, other block options.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    require(isinstance(model, EncoderLM), f"{type(model).__name__} is not an EncoderLM")
    c = model.config
    require(c.positional == "rotary", f"positional={c.positional!r} (only 'rotary')")
    require(c.ffn in GATED_ACTIVATIONS, f"ffn={c.ffn!r} (one of {sorted(GATED_ACTIVATIONS)})")
    require(c.norm == "layernorm", f"norm={c.norm!r} (only 'layernorm')")
    require(c.sublayer == "pre_norm", f"sublayer={c.sublayer!r} (only 'pre_norm')")
    require(c.attention == "mha" and c.n_kv_heads == c.n_heads, f"n_kv_heads={c.n_kv_heads} != n_heads={c.n_heads}")
    require(c.d_head * c.n_heads == c.d_model and c.d_value == c.d_head,
            f"d_head={c.d_head}, d_value={c.d_value} (must be d_model / n_heads)")
    require(c.type_vocab_size == 0, f"type_vocab_size={c.type_vocab_size} (ModernBERT has no segment embeddings)")
    require(not c.scale_embeddings and c.logit_softcap is None and c.output_scale == 1.0,
            "embedding scaling, logit soft-capping or an output scale")
    allowed = {"positional": {"base"}, "attention": {"bias"}, "ffn": {"bias"}, "norm": {"bias"}}
    for key, values in c.options.items():
        require(set(values) <= allowed.get(key, set()), f"{key} options {sorted(values)}")
    global_base = c.block_options("positional").get("base", 10000.0)
    windows, local_bases = set(), set()
    types = []
    for i in range(c.n_layers):
        entry = c.layer_options[i] if c.layer_options else {}
        layer = entry.get("layer", {})
        require(layer == ({"attention_norm": "identity"} if i == 0 else {}),
                f"layer_options[{i}]['layer'] = {layer} (ModernBERT's layer 0, and only it, has no attention norm)")
        require(set(entry) <= {"layer", "attention", "positional"} and set(entry.get("attention", {})) <= {"window"}
                and set(entry.get("positional", {})) <= {"base"}, f"layer_options[{i}] = {entry}")
        window = entry.get("attention", {}).get("window")
        base = entry.get("positional", {}).get("base", global_base)
        if window is None:
            require(base == global_base, f"layer_options[{i}]: a global layer with its own rotary base {base}")
            types.append("full_attention")
        else:
            windows.add(window)
            local_bases.add(base)
            types.append("sliding_attention")
    require(len(windows) <= 1 and len(local_bases) <= 1,
            f"local layers with different windows {sorted(windows)} or rotary bases {sorted(local_bases)}")
    window = windows.pop() if windows else 1
    local_base = local_bases.pop() if local_bases else global_base
    bias = {kind: c.block_options(kind).get("bias", c.bias) for kind in ("attention", "ffn")}
    config = {
        "model_type": "modernbert", "architectures": ["ModernBertForMaskedLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "hidden_activation": GATED_ACTIVATIONS[c.ffn],
        "max_position_embeddings": c.max_len, "norm_eps": c.norm_eps,
        "norm_bias": c.block_options("norm").get("bias", True), "attention_bias": bias["attention"],
        "mlp_bias": bias["ffn"], "classifier_bias": c.bias, "decoder_bias": True, "classifier_activation": "gelu",
        "attention_dropout": c.attention_dropout, "embedding_dropout": c.dropout, "mlp_dropout": c.dropout,
        "layer_types": types, "local_attention": 2 * (window - 1),  # the zoo's window w is |i - j| <= w - 1
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": global_base},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_base},
        },
        "pad_token_id": c.pad_token_id, "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
        "mask_token_id": c.mask_token_id, "tie_word_embeddings": c.tie_embeddings,
    }
    state = tensors(model)
    tied = ("mlm_head.decoder.weight",) if c.tie_embeddings else ()
    out = write_mapped(state, NAMES, skip=tuple(k for k in state if _FUSED_KEY.fullmatch(k)) + tied)
    for i in range(c.n_layers):
        for p in ("weight", "bias"):
            q = state.get(f"layers.{i}.self_attn.q_proj.{p}")
            if q is not None:
                out[f"model.layers.{i}.attn.Wqkv.{p}"] = torch.cat(
                    [q, state[f"layers.{i}.self_attn.k_proj.{p}"], state[f"layers.{i}.self_attn.v_proj.{p}"]])
            gate = state.get(f"layers.{i}.ffn.gate_proj.{p}")
            if gate is not None:
                out[f"model.layers.{i}.mlp.Wi.{p}"] = torch.cat([gate, state[f"layers.{i}.ffn.up_proj.{p}"]])
    return config, out


def _preset(n_layers: int, every: int, window: int, **fields: Any) -> dict[str, Any]:
    types = ["sliding_attention" if i % every else "full_attention" for i in range(n_layers)]
    return dict(
        n_layers=n_layers, positional="rotary", ffn="geglu", norm="layernorm", norm_eps=1e-5, sublayer="pre_norm",
        bias=False, tie_embeddings=True, type_vocab_size=0, dropout=0.0, attention_dropout=0.0,
        options={"positional": {"base": 160000.0}, "norm": {"bias": False}},
        layer_options=modernbert_layer_options(types, window, 160000.0, 10000.0), **fields,
    )


# A tiny ModernBERT for tests (global layer 0, local layers 1 and 2 with a 9-token window, i.e. local_attention=16)
# and ModernBERT-base (22 layers, every third global, local_attention=128).
EncoderLM.register_preset("modernbert-tiny", _preset(
    3, 3, 9, vocab_size=1001, d_model=64, n_heads=4, d_ff=96, max_len=256, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, mask_token_id=4,
))
EncoderLM.register_preset("modernbert-base", _preset(
    22, 3, 65, vocab_size=50368, d_model=768, n_heads=12, d_ff=1152, max_len=8192, pad_token_id=50283,
    bos_token_id=50281, eos_token_id=50282, mask_token_id=50284,
))

def _head_options(cfg: Mapping[str, Any], pooling: bool) -> dict[str, Any]:
    """The zoo head options of ModernBERT's task head (dense + ``classifier_activation`` + norm, dropout)."""
    reader = HFConfig("modernbert", cfg, {**DEFAULTS, "classifier_activation": "gelu", "classifier_dropout": 0.0,
                                          "classifier_pooling": "cls"})
    options = {"pre_classifier": "modernbert", "activation": reader.activation("classifier_activation"),
               "classifier_dropout": float(reader["classifier_dropout"])}
    return {**options, "pooling": reader["classifier_pooling"]} if pooling else options


def _head_fields(options: Mapping[str, Any], config: Any) -> dict[str, Any]:
    fields = {"classifier_activation": ACTIVATION_NAMES[options.get("activation", "gelu")],
              "classifier_dropout": options.get("classifier_dropout") or 0.0}
    return {**fields, "classifier_pooling": options["pooling"]} if "pooling" in options else fields


# The task classes: ModernBERT's head (dense + activation + norm) on the pooled state or on every token.
_HEAD_NAMES = {"head.dense": "dense", "head.norm": "norm", "classifier": "classifier"}
register_tasks(TaskLayout("modernbert", "model.", (
    TaskClass("ModernBertForSequenceClassification", "sequence_classification", "model.", _HEAD_NAMES,
              lambda cfg: _head_options(cfg, True), _head_fields,
              requires={"pre_classifier": "modernbert", "pooling": ("cls", "mean"), "classifier_bias": True}),
    TaskClass("ModernBertForTokenClassification", "token_classification", "model.", _HEAD_NAMES,
              lambda cfg: _head_options(cfg, False), _head_fields,
              requires={"pre_classifier": "modernbert", "classifier_bias": True}),
    TaskClass("ModernBertForQuestionAnswering", "question_answering", "model.", _HEAD_NAMES,
              lambda cfg: _head_options(cfg, False), _head_fields,
              requires={"pre_classifier": "modernbert", "classifier_bias": True}),
)))
