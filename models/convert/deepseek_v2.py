"""DeepSeek-V2 (``model_type: deepseek_v2``) <-> ``DecoderLM``, and the machinery DeepSeek-V3 shares.

A DeepSeek model is a ``DecoderLM`` with multi-head latent attention (attention ``mla``: low-rank key/value latent,
optional low-rank queries, decoupled rotary dimensions) and the ``moe`` FFN with ungated shared experts
(``n_shared_experts · moe_intermediate_size`` wide). Its first ``first_k_dense_replace`` layers are dense: in the
zoo they are ``moe`` blocks with no routed experts (``n_experts=0``), whose shared expert is the dense MLP
(``intermediate_size`` wide), a per-layer option. DeepSeek-V2 routes with a softmax, ``greedy`` (router ``softmax``)
or ``group_limited_greedy`` (router ``softmax_group``), and scales the kept weights by ``routed_scaling_factor``.

Layouts: the config's ``d_head`` is the query/key width ``qk_nope_head_dim + qk_rope_head_dim`` and ``d_value`` is
``v_head_dim``; the rotary encoding rotates ``qk_rope_head_dim`` of them (``fraction``) in interleaved pairs, as
DeepSeek's checkpoints do (V3 with ``rope_interleave=False`` uses the rotate-half layout). With YaRN the score scale
is multiplied by ``mscale(factor, mscale_all_dim)²`` as ``transformers`` does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

from ..decoder_lm import DecoderLM, DecoderLMConfig
from .export import register_exporter, require, tensors
from .hf_checkpoint import CheckpointReader, HFConfig, rope_parameters, zoo_config
from .llama import DEFAULTS as LLAMA_DEFAULTS
from .llama import GATED_ACTIVATIONS, GATED_FFNS, NAMES
from .mixtral import PLAIN_EXPERT, dense_mlps_as_shared, unfuse_experts
from .name_maps import NameMap, read_mapped, write_mapped
from .registry import Converted, register_converter
from .tasks import TaskLayout, decoder_classes, register_tasks

# DeepseekV2Config's defaults in transformers 5.
DEFAULTS: dict[str, Any] = {
    **LLAMA_DEFAULTS, "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "first_k_dense_replace": 0, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "n_group": None, "n_routed_experts": 64, "n_shared_experts": 2, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "topk_group": None, "topk_method": "greedy",
    "norm_topk_prob": False, "v_head_dim": 128, "num_experts_per_tok": None, "moe_intermediate_size": 1407,
    "output_router_logits": False, "router_aux_loss_coef": 0.001, "rope_interleave": True,
}

_ATTENTION = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
              "o_proj")
_BIAS = "e_score_correction_bias"


def deepseek_names(n_experts: int) -> NameMap:
    """Llama's name map with latent attention's linears and norms, the router ``mlp.gate``, routed experts
    ``mlp.experts.<e>.*`` and the shared experts ``mlp.shared_experts.*`` (a dense layer's MLP is renamed to them).

    Args:
        n_experts: the number of routed experts.

    Returns:
        The zoo -> ``transformers`` name map.
    """
    layer = {k: v for k, v in NAMES.layer.items() if not k.startswith(("ffn.", "self_attn."))}
    layer.update({f"self_attn.{name}": f"self_attn.{name}" for name in _ATTENTION})
    layer["ffn.router"] = "mlp.gate"
    for e in range(n_experts):
        layer.update({f"ffn.experts.{e}.{name}": f"mlp.experts.{e}.{name}" for name in PLAIN_EXPERT})
    layer.update({f"ffn.shared_expert.{name}": f"mlp.shared_experts.{name}" for name in PLAIN_EXPERT})
    return dataclasses.replace(NAMES, layer=layer)


def rotary_fraction(d_rope: int, d_head: int) -> float:
    """The rotary ``fraction`` whose ``int(d_head · fraction)`` is exactly ``d_rope`` (``d_rope / d_head``, one ulp
    up where rounding would drop a dimension).

    Args:
        d_rope: the rotated dimensions of a head.
        d_head: the head's query/key width.

    Returns:
        The fraction.
    """
    fraction = d_rope / d_head
    return fraction if int(d_head * fraction) == d_rope else math.nextafter(fraction, 1.0)


def mla_scale(cfg: HFConfig, d_head: int) -> float | None:
    """The score scale when YaRN's ``mscale_all_dim`` changes it (``d_head^-½ · mscale²``), else None.

    Args:
        cfg: the checkpoint's config.
        d_head: the head's query/key width.

    Returns:
        The scale, or None for the default ``d_head^-½``.
    """
    rope = dict(cfg.data.get("rope_scaling") or cfg.data.get("rope_parameters") or {})
    kind, m_all = rope.get("rope_type", rope.get("type", "default")), rope.get("mscale_all_dim") or 0
    if kind == "default" or not m_all:
        return None
    factor = float(rope["factor"])
    mscale = 1.0 if factor <= 1 else 0.1 * float(m_all) * math.log(factor) + 1.0
    return d_head ** -0.5 * mscale * mscale


def dense_layers(cfg: HFConfig, n_layers: int) -> int:
    """``first_k_dense_replace`` (None: 0), checked to be an integer in ``[0, num_hidden_layers]``.

    Args:
        cfg: the checkpoint's config.
        n_layers: the number of layers.

    Returns:
        The number of first layers with a dense MLP.

    Raises:
        ValueError: another value.
    """
    dense = cfg["first_k_dense_replace"] or 0
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense <= n_layers:
        raise cfg.unsupported("first_k_dense_replace", "the number of dense first layers",
                              f"an integer in [0, num_hidden_layers={n_layers}]")
    return dense


def deepseek_fields(cfg: HFConfig, router: Mapping[str, Any], interleaved: bool) -> dict[str, Any]:
    """The ``DecoderLMConfig`` fields of a DeepSeek checkpoint; ``router``: the family's router options.

    Args:
        cfg: the checkpoint's config.
        router: the family's router options of the ``moe`` block.
        interleaved: whether the rotary encoding rotates interleaved pairs (``rotary_interleaved``).

    Returns:
        The fields, as keyword arguments of ``DecoderLMConfig``.

    Raises:
        ValueError: an activation without a gated zoo FFN, MLP biases, a kv rank larger than the width, a RoPE type
            the zoo lacks, or more experts per token than experts (the field named).
    """
    # num_key_value_heads is not read: latent attention has no key/value head groups (transformers' config
    # defaults it to 128 whatever the heads).
    d_model, n_heads = cfg.positive_int("hidden_size"), cfg.positive_int("num_attention_heads")
    if cfg["hidden_act"] not in GATED_FFNS:
        raise cfg.unsupported("hidden_act", "the gated FFN's activation", "the activations " + ", ".join(GATED_FFNS))
    cfg.require("mlp_bias", [False], "biases on the MLPs")
    d_rope, d_nope = cfg.positive_int("qk_rope_head_dim"), cfg.positive_int("qk_nope_head_dim")
    d_head = d_rope + d_nope
    n_experts, top_k = cfg.positive_int("n_routed_experts"), cfg.positive_int("num_experts_per_tok")
    if top_k > n_experts:
        raise cfg.unsupported("num_experts_per_tok", f"experts per token out of n_routed_experts={n_experts}",
                              f"num_experts_per_tok <= {n_experts}")
    shared = cfg["n_shared_experts"] or 0
    d_ff = cfg.positive_int("moe_intermediate_size")
    attention: dict[str, Any] = {"kv_lora_rank": cfg.positive_int("kv_lora_rank"), "d_rope": d_rope,
                                 "q_lora_rank": None if cfg["q_lora_rank"] is None else cfg.positive_int("q_lora_rank")}
    if cfg["attention_bias"]:
        attention["bias"] = True
    scale = mla_scale(cfg, d_head)
    if scale is not None:
        attention["scale"] = scale
    # transformers' DeepSeek models add no router loss to theirs, whatever output_router_logits says.
    ffn = {"n_experts": n_experts, "top_k": top_k, "expert": GATED_FFNS[cfg["hidden_act"]],
           "d_shared": int(shared) * d_ff, "aux_loss_coef": 0.0, **router}
    n_layers = cfg.positive_int("num_hidden_layers")
    dense = dense_layers(cfg, n_layers)
    dense_options = {"ffn": {"n_experts": 0, "top_k": 0, "d_shared": cfg.positive_int("intermediate_size")}}
    positional = {**cfg.rope_options(10000.0), "fraction": rotary_fraction(d_rope, d_head)}
    return dict(
        vocab_size=cfg.positive_int("vocab_size"), d_model=d_model, n_heads=n_heads, n_kv_heads=n_heads,
        d_head=d_head, d_value=cfg.positive_int("v_head_dim"), d_ff=d_ff, n_layers=n_layers,
        max_len=cfg.positive_int("max_position_embeddings"), dropout=0.0,
        attention_dropout=cfg.probability("attention_dropout"),
        positional="rotary_interleaved" if interleaved else "rotary", ffn="moe", attention="mla", norm="rmsnorm",
        norm_eps=float(cfg["rms_norm_eps"]), sublayer="pre_norm", bias=False,
        tie_embeddings=bool(cfg["tie_word_embeddings"]),
        options={"positional": positional, "attention": attention, "ffn": ffn},
        layer_options=tuple(dense_options if i < dense else {} for i in range(n_layers)) if dense else (),
        **cfg.token_ids("pad_token_id", "bos_token_id", "eos_token_id"),
    )


def convert_deepseek_like(model_type: str, hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor],
                          defaults: Mapping[str, Any], fields: Callable[[HFConfig], dict[str, Any]]) -> Converted:
    """Convert a DeepSeek checkpoint (per-expert or fused expert tensors) with the family's ``fields``.

    Args:
        model_type: the family.
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.
        defaults: the family's config defaults.
        fields: reads the zoo config fields from the config.

    Returns:
        The zoo ``DecoderLM``, its config and state dict.

    Shapes: fused expert tensors ``(n_experts, ...)`` are split into one tensor per expert; the others keep
    their shapes.
    """
    cfg = HFConfig(model_type, hf_config, defaults, aliases={"n_routed_experts": "num_experts"})
    config = zoo_config(model_type, DecoderLMConfig, **fields(cfg))
    dense = dense_layers(cfg, config.n_layers)
    # a dense layer's MLP is its block's shared expert (as Qwen-MoE's mlp_only_layers, models.convert.mixtral)
    state = dense_mlps_as_shared(unfuse_experts(state_dict, "mlp", PLAIN_EXPERT), set(range(dense)), "shared_experts")
    ckpt = CheckpointReader(model_type, state, ignore=[r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"])
    names = deepseek_names(config.block_options("ffn")["n_experts"])
    biases = [f"layers.{i}.ffn.{_BIAS}" for i in range(dense, config.n_layers)
              if config.block_options("ffn")["router"] == "sigmoid_group"]
    tied = config.tie_embeddings
    out = read_mapped(ckpt, names, DecoderLM, config, skip=(*biases, *(("lm_head.weight",) if tied else ())))
    for key in biases:
        out[key] = ckpt.take(f"model.{key.replace('ffn.', 'mlp.gate.')}")
    if tied:
        ckpt.skip("lm_head.weight")
    ckpt.finish()
    return Converted(DecoderLM, config, out, frozenset())


def export_deepseek_like(model: nn.Module, model_type: str, architecture: str,
                         extra: Callable[[DecoderLMConfig, dict[str, Any]], dict[str, Any]]) -> tuple[dict, dict]:
    """A DeepSeek config and per-expert state dict; ``extra(config, ffn options)`` gives the family's router fields
    (and raises ``NotExportable`` for a router it lacks).

    Args:
        model: the zoo ``DecoderLM``.
        model_type: the family.
        architecture: the ``transformers`` class name to record.
        extra: the family's router fields.

    Returns:
        ``(config, state_dict)`` under ``transformers`` names, one tensor per expert.

    Raises:
        NotExportable: parts DeepSeek lacks (attention other than ``mla``, per-layer options other than the first
            layers' dense MLP, a z-loss, biases on the MLPs, ...).
    """
    require(isinstance(model, DecoderLM), f"{type(model).__name__} is not a DecoderLM")
    c = model.config
    require(c.attention == "mla" and c.ffn == "moe", f"attention={c.attention!r}, ffn={c.ffn!r} (only 'mla', 'moe')")
    require(c.positional in ("rotary", "rotary_interleaved"), f"positional={c.positional!r}")
    require(c.norm == "rmsnorm" and c.sublayer == "pre_norm" and c.layer == "decoder" and not c.bias,
            "a norm, sublayer, layer or MLP bias DeepSeek lacks")
    require(not c.scale_embeddings and c.logit_softcap is None and c.output_scale == 1.0,
            "scaled embeddings, logit soft-capping or an output scale")
    ffn, attention, rotary = (c.block_options(k) for k in ("ffn", "attention", "positional"))
    require(set(attention) <= {"kv_lora_rank", "q_lora_rank", "d_rope", "bias", "scale"},
            f"attention options {sorted(attention)}")
    require(set(rotary) <= {"base", "scaling", "fraction"}, f"rotary options {sorted(rotary)}")
    require(not ffn.get("z_loss_coef") and not ffn.get("aux_loss_coef"),
            "a router loss (transformers' DeepSeek models add none to theirs)")
    require(ffn.get("expert", "swiglu") in GATED_ACTIVATIONS and ffn.get("d_shared"),
            "a non-gated expert or no shared expert")
    dense = 0
    for i, entry in enumerate(c.layer_options):
        if entry.get("ffn", {}).get("n_experts") == 0 and dense == i:
            dense += 1
        else:
            require(not entry, f"layer_options[{i}] = {entry} (only the first layers' dense MLP)")
    d_dense = [c.block_options("ffn", i)["d_shared"] for i in range(dense)]
    require(len(set(d_dense)) <= 1, f"dense layers of different widths {d_dense}")
    d_shared = ffn.get("d_shared", 0)
    require(d_shared % c.d_ff == 0, f"d_shared={d_shared} is not a multiple of d_ff={c.d_ff} (n_shared_experts)")
    d_rope = attention.get("d_rope", 64)
    rope = {k: v for k, v in rope_parameters(rotary).items() if k != "partial_rotary_factor"}
    scale = attention.get("scale") or c.d_head ** -0.5
    implied = mla_scale(HFConfig(model_type, {"rope_parameters": rope}, {}), c.d_head) or c.d_head ** -0.5
    require(math.isclose(scale, implied, rel_tol=1e-9), f"attention scale {scale} (DeepSeek's rope gives {implied})")
    n_experts = ffn.get("n_experts", 8)
    config: dict[str, Any] = {
        "model_type": model_type, "architectures": [architecture], "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "intermediate_size": d_dense[0] if d_dense else c.d_ff,
        "moe_intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_heads, "hidden_act": GATED_ACTIVATIONS[ffn.get("expert", "swiglu")],
        "max_position_embeddings": c.max_len, "rms_norm_eps": c.norm_eps, "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": c.attention_dropout, "attention_bias": bool(attention.get("bias", False)),
        "rope_parameters": rope, "rope_theta": rope["rope_theta"], "pad_token_id": c.pad_token_id,
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "first_k_dense_replace": dense,
        "kv_lora_rank": attention.get("kv_lora_rank", 512), "q_lora_rank": attention.get("q_lora_rank"),
        "qk_rope_head_dim": d_rope, "qk_nope_head_dim": c.d_head - d_rope, "v_head_dim": c.d_value,
        "n_routed_experts": n_experts, "n_shared_experts": d_shared // c.d_ff,
        "num_experts_per_tok": ffn.get("top_k", 2), "routed_scaling_factor": ffn.get("routed_scaling_factor", 1.0),
    }
    config.update(extra(c, ffn))
    state = tensors(model)
    biases = [k for k in state if k.endswith(f".ffn.{_BIAS}")]
    out = write_mapped(state, deepseek_names(n_experts), skip=(*biases, *(("lm_head.weight",) if c.tie_embeddings
                                                                          else ())))
    for key in biases:
        out[f"model.{key.replace('ffn.', 'mlp.gate.')}"] = state[key]
    for i in range(dense):  # a dense layer's shared expert is its MLP
        for proj in PLAIN_EXPERT:
            out[f"model.layers.{i}.mlp.{proj}.weight"] = out.pop(f"model.layers.{i}.mlp.shared_experts.{proj}.weight")
    return config, out


def _v2_fields(cfg: HFConfig) -> dict[str, Any]:
    method = cfg["topk_method"]
    if method == "greedy":
        router: dict[str, Any] = {"router": "softmax"}
    elif method == "group_limited_greedy":
        router = {"router": "softmax_group", "n_group": cfg.positive_int("n_group"),
                  "topk_group": cfg.positive_int("topk_group")}
    else:
        raise cfg.unsupported("topk_method", "the router's top-k", "topk_method='greedy' or 'group_limited_greedy'")
    # transformers' DeepSeek-V2 never renormalises the kept weights (norm_topk_prob is not read).
    router.update(renormalize=False, routed_scaling_factor=float(cfg["routed_scaling_factor"]))
    return deepseek_fields(cfg, router, interleaved=True)


@register_converter("deepseek_v2")
def convert_deepseek_v2(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Convert a ``DeepseekV2ForCausalLM`` checkpoint (per-expert or fused expert tensors).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``).

    Raises:
        ValueError: a ``topk_method`` other than ``greedy`` / ``group_limited_greedy``, ``n_group`` not dividing the
            experts, ``topk_group > n_group``, or as ``deepseek_fields`` (the field named).

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    return convert_deepseek_like("deepseek_v2", hf_config, state_dict, DEFAULTS, _v2_fields)


@register_exporter("deepseek_v2")
def export_deepseek_v2(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``DeepseekV2ForCausalLM`` config and per-expert state dict for a DeepSeek-V2-shaped ``DecoderLM``.

    Args:
        model: the zoo model to export.

    Returns:
        ``(config, state_dict)``: the ``transformers`` ``config.json`` dict and the tensors under its names.

    Raises:
        NotExportable: a router other than ``softmax`` / ``softmax_group`` without renormalisation, the rotate-half
            rotary layout, or parts DeepSeek lacks.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """

    def extra(c: DecoderLMConfig, ffn: dict[str, Any]) -> dict[str, Any]:
        router = ffn.get("router", "softmax")
        require(router in ("softmax", "softmax_group"), f"router={router!r} (DeepSeek-V2 routes by softmax)")
        require(not ffn.get("renormalize", True), "renormalised weights (DeepSeek-V2 keeps them as they are)")
        require(c.positional == "rotary_interleaved", "the rotate-half rotary layout (DeepSeek-V2 interleaves)")
        grouped = router == "softmax_group"
        return {"topk_method": "group_limited_greedy" if grouped else "greedy", "norm_topk_prob": False,
                "n_group": ffn.get("n_group", 1) if grouped else None,
                "topk_group": ffn.get("topk_group", 1) if grouped else None}

    return export_deepseek_like(model, "deepseek_v2", "DeepseekV2ForCausalLM", extra)


_V2_TINY_FFN = {"n_experts": 6, "top_k": 2, "router": "softmax_group", "n_group": 3, "topk_group": 2,
                "renormalize": False, "routed_scaling_factor": 1.5, "d_shared": 48}
DecoderLM.register_preset("deepseek_v2-tiny", dict(
    vocab_size=1000, d_model=64, n_heads=4, d_head=24, d_value=16, d_ff=24, n_layers=2, max_len=256, dropout=0.0,
    positional="rotary_interleaved", ffn="moe", attention="mla", norm="rmsnorm", norm_eps=1e-6,
    sublayer="pre_norm", bias=False, tie_embeddings=False, pad_token_id=None, bos_token_id=1, eos_token_id=2,
    options={"positional": {"base": 10000.0, "fraction": rotary_fraction(8, 24)},
             "attention": {"kv_lora_rank": 32, "q_lora_rank": None, "d_rope": 8}, "ffn": _V2_TINY_FFN},
    layer_options=({"ffn": {"n_experts": 0, "top_k": 0, "d_shared": 96}}, {}),
))
# DeepSeek-V2-Lite (15.7B total, 2.4B active): no query compression, 64 experts, one dense first layer.
DecoderLM.register_preset("deepseek-v2-lite", dict(
    vocab_size=102400, d_model=2048, n_heads=16, d_head=192, d_value=128, d_ff=1408, n_layers=27, max_len=163840,
    dropout=0.0, positional="rotary_interleaved", ffn="moe", attention="mla", norm="rmsnorm", norm_eps=1e-6,
    sublayer="pre_norm", bias=False, tie_embeddings=False, pad_token_id=None, bos_token_id=100000,
    eos_token_id=100001,
    options={"positional": {"base": 10000.0, "fraction": rotary_fraction(64, 192), "scaling": {
        "type": "yarn", "factor": 40.0, "original_max_len": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.707, "mscale_all_dim": 0.707}},
        "attention": {"kv_lora_rank": 512, "q_lora_rank": None, "d_rope": 64,
                      "scale": 192 ** -0.5 * (0.1 * 0.707 * math.log(40.0) + 1.0) ** 2},
        "ffn": {"n_experts": 64, "top_k": 6, "router": "softmax", "renormalize": False, "d_shared": 2816}},
    layer_options=({"ffn": {"n_experts": 0, "top_k": 0, "d_shared": 10944}}, *({},) * 26),
))

# The task classes: transformers has DeepseekV2ForSequenceClassification only (score on the last real token).
register_tasks(TaskLayout("deepseek_v2", "model.", decoder_classes("model.", None, stem="DeepseekV2")[:1]))
