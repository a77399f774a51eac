"""LoRA adapters: the registered block, adding/merging/switching, parity with ``peft`` in both directions, files."""

from __future__ import annotations

import copy
import json
import logging
import warnings
from pathlib import Path

import peft
import pytest
import torch
import transformers
from torch import nn

import blocks
from blocks.adapters import AdaptedLinear, LoRA
from models import DecoderLM, EncoderLM, Seq2SeqConfig, Seq2SeqTransformer
from models.checkpoints.peft_names import name_map, name_maps
from models.convert import save_transformers, supported_model_types, to_transformers
from models.vit import VisionTransformer

VOCAB = 50
TINY = dict(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0, attention_dropout=0.0)


def gpt2_like(**overrides) -> DecoderLM:
    return DecoderLM.from_preset("tiny", **{**TINY, "max_len": 32, **overrides}).eval()


def bert_like(**overrides) -> EncoderLM:
    # BERT: post-norm, exact GELU, learned positions, segment embeddings.
    return EncoderLM.from_preset("tiny", **{**TINY, "max_len": 32, "ffn": "gelu", "type_vocab_size": 2,
                                            **overrides}).eval()


def ids(batch: int = 2, length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def randomize_lora(model: nn.Module, seed: int = 0, std: float = 0.2) -> None:
    """Give every adapter a non-zero B (a fresh LoRA changes nothing, which would make the parity tests vacuous)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(model, Seq2SeqTransformer):
            return model(x, x[:, :4]).logits
        return model(x).logits


def hf_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x).logits


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # peft: "fan_in_fan_out is set to False but ... Conv1D"
        yield


# ---------------------------------------------------------------------------------------------- the block
def test_lora_is_a_registered_adapter_and_computes_scaled_low_rank_update() -> None:
    assert blocks.get("adapter", "lora") is LoRA
    lora = blocks.build("adapter", "lora", in_features=6, out_features=5, r=3, alpha=6.0)
    torch.nn.init.normal_(lora.lora_B)
    x = torch.randn(4, 6)
    expected = x @ (lora.lora_B @ lora.lora_A).T * (6.0 / 3)  # the formula, ΔW x with ΔW = alpha/r · B A
    torch.testing.assert_close(lora(x), expected)
    torch.testing.assert_close(lora.delta_weight(), lora.lora_B @ lora.lora_A * 2.0)
    assert torch.equal(blocks.build("adapter", "lora", in_features=6, out_features=5).lora_B, torch.zeros(5, 8))


@pytest.mark.parametrize(
    ("options", "match"),
    [({"r": 0}, "r must be a positive integer"), ({"r": -2}, "r must be a positive integer"),
     ({"r": 2.5}, "r must be"), ({"dropout": 1.0}, "dropout"), ({"alpha": float("nan")}, "alpha"),
     ({"rank": 4}, "unknown config key")],
)
def test_bad_lora_options_are_refused_before_the_model_changes(options: dict, match: str) -> None:
    model = gpt2_like()
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=match):
        model.add_adapter("lora", target_modules=["q_proj"], **options)
    assert [type(m) for m in model.modules()] == before
    assert all(p.requires_grad for p in model.parameters())


# ---------------------------------------------------------------------------------------------- adding, targets
@pytest.mark.parametrize("cls", [DecoderLM, EncoderLM, Seq2SeqTransformer])
def test_fresh_lora_leaves_logits_bit_identical(cls) -> None:
    model = cls.from_preset("tiny", **{k: v for k, v in TINY.items() if k != "n_layers"}).eval()
    x = ids()
    before = logits(model, x)
    adapted = model.add_adapter(r=4, alpha=8, target_modules="all-linear")
    assert "lm_head" not in adapted and len(adapted) > 6
    assert torch.equal(logits(model, x), before)


def test_only_the_active_adapter_gets_gradients() -> None:
    model = gpt2_like().train()
    model.add_adapter(r=2, target_modules=["q_proj", "v_proj"], name="first")
    model.add_adapter(r=2, target_modules=["up_proj"], name="second")
    x = ids()
    model(x, labels=x).loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert with_grad == trainable
    assert with_grad == {f"layers.{i}.ffn.up_proj.adapters.second.lora_{ab}" for i in range(2) for ab in "AB"}
    model.set_adapter("first")
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"layers.{i}.self_attn.{q}_proj.adapters.first.lora_{ab}" for i in range(2) for q in "qv" for ab in "AB"
    }


def test_target_patterns_select_layers_by_suffix_regex_or_all_linear() -> None:
    model = gpt2_like()
    assert model.add_adapter(target_modules=["layers.1.self_attn.q_proj", "down_proj"], name="a") == [
        "layers.0.ffn.down_proj", "layers.1.self_attn.q_proj", "layers.1.ffn.down_proj"]
    assert model.add_adapter(target_modules=r"layers\.0\..*_proj", name="b") == [
        f"layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                  "ffn.up_proj", "ffn.down_proj")]
    assert model.adapter_names == ["a", "b"] and model.active_adapter == "b"
    # Parameter names of the base model are unchanged, so save_pretrained / exporters keep working.
    assert "layers.0.self_attn.q_proj.weight" in dict(model.named_parameters())


@pytest.mark.parametrize(
    ("targets", "match"),
    [(["q_prj"], "'q_prj' matches no linear layer"), (["self_attn"], "matches no linear layer"),
     ("nothing.*here", "matches no linear layer"), ("(", "not a valid regular expression"),
     ([], "non-empty list"), (["lm_head"], "tied to"), (3, "non-empty list")],
)
def test_bad_targets_raise_value_error(targets, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gpt2_like().add_adapter(target_modules=targets)


def test_names_must_be_new_and_known() -> None:
    model = gpt2_like()
    model.add_adapter(target_modules=["q_proj"])
    with pytest.raises(ValueError, match="already has an adapter named 'default'"):
        model.add_adapter(target_modules=["v_proj"])
    with pytest.raises(ValueError, match="adapter name"):
        model.add_adapter(target_modules=["v_proj"], name="a.b")
    with pytest.raises(ValueError, match="no adapter named 'other'"):
        model.set_adapter("other")
    with pytest.raises(ValueError, match="unknown adapter 'prefix'"):
        model.add_adapter("prefix", target_modules=["v_proj"], name="p")


# ---------------------------------------------------------------------------------------------- merge, switch
def test_merge_keeps_logits_and_unmerge_restores_the_base_weights() -> None:
    model = gpt2_like()
    base_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = ids()
    model.add_adapter(r=4, alpha=8, target_modules="all-linear")
    randomize_lora(model)
    unmerged = logits(model, x)
    model.merge_adapter()
    assert all(layer.merged == "default" for _, layer in model._adapted_layers())
    torch.testing.assert_close(logits(model, x), unmerged, atol=1e-5, rtol=1e-5)
    q = model.layers[0].self_attn.q_proj
    torch.testing.assert_close(q.weight, base_weights["layers.0.self_attn.q_proj.weight"] + q.adapters["default"]
                               .delta_weight())
    model.unmerge_adapter()
    for n, p in model.named_parameters():
        if n in base_weights:
            torch.testing.assert_close(p, base_weights[n], atol=1e-6, rtol=0)
    torch.testing.assert_close(logits(model, x), unmerged, atol=1e-5, rtol=1e-5)


def test_merge_and_unload_gives_a_plain_model_that_saves_and_exports(tmp_path: Path) -> None:
    model = gpt2_like()
    model.add_adapter(r=2, target_modules=["q_proj", "up_proj"])
    randomize_lora(model)
    x = ids()
    adapted = logits(model, x)
    model.merge_and_unload()
    assert not any(isinstance(m, AdaptedLinear) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())
    model.save_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(DecoderLM.from_pretrained(tmp_path / "merged"), x), adapted, atol=1e-5, rtol=0)


def test_several_adapters_switch_and_none_runs_the_base_model() -> None:
    model = gpt2_like()
    x = ids()
    base = logits(model, x)
    model.add_adapter(r=2, target_modules=["q_proj"], name="a")
    randomize_lora(model, seed=1)
    only_a = logits(model, x)
    model.add_adapter(r=3, target_modules=["v_proj", "up_proj"], name="b")
    randomize_lora(model, seed=2)  # also re-draws a's B
    only_b = logits(model, x)
    model.set_adapter("a")
    a_again = logits(model, x)
    assert not torch.allclose(a_again, only_b) and not torch.allclose(a_again, base)
    model.set_adapter(None)
    assert torch.equal(logits(model, x), base)
    model.set_adapter("b")
    assert torch.equal(logits(model, x), only_b)
    model.merge_adapter()
    model.set_adapter("a")  # switching unmerges b first
    torch.testing.assert_close(logits(model, x), a_again, atol=1e-5, rtol=0)
    model.delete_adapter("a")
    assert model.adapter_names == ["b"] and model.active_adapter is None
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear  # a was the only adapter there
    assert only_a.shape == base.shape


# ---------------------------------------------------------------------------------------------- runtime paths
@pytest.mark.parametrize("backend", blocks.names("attention_backend"))
def test_adapter_under_every_attention_backend(backend: str) -> None:
    model = gpt2_like()
    model.add_adapter(r=4, target_modules="all-linear")
    randomize_lora(model)
    x = ids()
    reference = logits(model, x)
    model.set_attention_backend(backend)
    torch.testing.assert_close(logits(model, x), reference, atol=1e-5, rtol=1e-5)


def test_generation_with_the_kv_cache_follows_the_adapted_model() -> None:
    model = gpt2_like()
    model.add_adapter(r=4, target_modules=["q_proj", "v_proj", "up_proj"])
    randomize_lora(model, std=0.5)
    prompt = ids(batch=2, length=4)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=6, do_sample=False)
        # Each cached greedy step must be the arg-max of a full, uncached forward pass of the adapted model.
        full = model(out[:, :-1]).logits.argmax(-1)
    assert torch.equal(out[:, 4:], full[:, 3:])
    model.set_adapter(None)
    with torch.no_grad():
        assert not torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), out)


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("_fresh_dynamo")
def test_compiled_adapted_model_matches_eager_forward_and_gradients() -> None:
    model = gpt2_like(n_layers=1)
    model.add_adapter(r=2, target_modules=["q_proj", "v_proj"])
    randomize_lora(model)
    x = ids()
    eager = model(x, labels=x).loss
    eager.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager")(x, labels=x).loss
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    assert set(eager_grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, g in eager_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g)


# ---------------------------------------------------------------------------------------------- the name map
def _seq2seq(positional: str) -> Seq2SeqTransformer:
    config = Seq2SeqConfig(**{k: v for k, v in TINY.items() if k != "n_layers"}, max_len=32, positional=positional,
                           embedding_norm=positional == "learned", output_bias=True, ffn="silu", bos_token_id=0,
                           eos_token_id=2, decoder_start_token_id=1)
    return Seq2SeqTransformer(config).eval()


EXPORTABLE = {
    "gpt2": gpt2_like, "bert": bert_like, "bart": lambda: _seq2seq("learned"),
    "marian": lambda: _seq2seq("sinusoidal_concat"),
    "vit": lambda: VisionTransformer.from_preset("tiny", d_model=16, n_heads=2, d_ff=32, n_layers=1),
    **{family: lambda family=family: DecoderLM.from_preset(f"{family}-tiny", vocab_size=VOCAB, n_layers=1).eval()
       for family in ("llama", "mistral", "qwen2", "qwen3")},
}


def tiny_of(model_type: str) -> nn.Module | None:
    """A tiny model of the family: from the table above, else the ``<family>-tiny`` preset a converter registers."""
    if model_type in EXPORTABLE:
        return EXPORTABLE[model_type]()
    preset = {"gemma3_text": "gemma3-tiny"}.get(model_type, f"{model_type}-tiny")
    for cls in (DecoderLM, EncoderLM, Seq2SeqTransformer, VisionTransformer):
        if preset in cls.presets:
            return cls.from_preset(preset).eval()
    return None


@pytest.mark.parametrize("model_type", supported_model_types())
def test_name_map_places_every_linear_weight_where_the_exporter_writes_it(model_type: str) -> None:
    """The probe's placements, applied to the *real* export, give back each zoo weight exactly."""
    model = tiny_of(model_type)
    if model is None:
        pytest.skip(f"no tiny {model_type} model")
    if model_type not in blocks.names("hf_exporter"):
        pytest.skip(f"{model_type} converts to the zoo but has no exporter")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # distinct values everywhere, so that a wrong placement cannot match by accident
    _, state = to_transformers(model, model_type)
    placements = name_map(model, model_type).placements
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    tied = {n for n, m in linears.items() if any(m.weight is e.weight for e in model.modules() if isinstance(
        e, nn.Embedding))}
    # Qwen2-MoE's router holds the shared-expert gate as its last row, exported as two tensors (mlp.gate,
    # mlp.shared_expert_gate): a weight with no single home has no placement, and adapting it raises.
    split = {n for n in linears if model_type == "qwen2_moe" and n.endswith("ffn.router")}
    # gpt-oss exports its experts as 3-D tensors (mlp.experts.gate_up_proj (E, H, 2I), interleaved): no 2-D home.
    split |= {n for n in linears if model_type == "gpt_oss" and ".ffn.experts." in n}
    assert set(placements) == set(linears) - tied - split and placements
    for zoo, p in placements.items():
        weight = state[p.module + ".weight"]
        weight = weight.t() if p.transposed else weight  # as an nn.Linear weight (out, in)
        assert torch.equal(weight[p.rows][:, p.cols], linears[zoo].weight.detach())


# ---------------------------------------------------------------------------------------------- peft parity
def transformers_copy(model: nn.Module, folder: Path) -> nn.Module:
    """The ``transformers`` model the zoo model's base (without adapters) exports to."""
    model = copy.deepcopy(model)
    model.set_adapter(None)
    save_transformers(model.merge_and_unload(), folder)
    auto = transformers.AutoModelForCausalLM if isinstance(model, DecoderLM) else transformers.AutoModelForMaskedLM
    return auto.from_pretrained(folder).eval()


CASES = {
    # (model, zoo targets, the transformers modules peft adapts)
    "gpt2": (gpt2_like, ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"], ["c_attn", "c_proj", "c_fc"]),
    "bert": (bert_like, ["q_proj", "v_proj", "down_proj"], ["query", "value", "output.dense"]),
    "llama": (lambda: DecoderLM.from_preset("llama-tiny", **{**TINY, "n_kv_heads": 1}).eval(),
              ["q_proj", "v_proj", "down_proj"], ["q_proj", "v_proj", "down_proj"]),
}


@pytest.mark.parametrize("family", list(CASES))
def test_zoo_adapter_saved_and_loaded_by_peft_gives_the_same_logits(family: str, tmp_path: Path) -> None:
    make, targets, _ = CASES[family]
    model = make()
    model.add_adapter(r=4, alpha=8, target_modules=targets)
    randomize_lora(model)
    x = ids()
    ours = logits(model, x)
    model.save_adapter(tmp_path / "adapter", base_model="tiny-base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == "tiny-base"

    model.set_adapter(None)
    base = logits(model, x)
    hf = transformers_copy(model, tmp_path / "hf")
    torch.testing.assert_close(hf_logits(hf, x), base, atol=1e-5, rtol=1e-5)  # the base models agree
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    theirs = hf_logits(adapted, x)
    assert (ours - base).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", list(CASES))
def test_peft_adapter_loaded_by_the_zoo_gives_the_same_logits(family: str, tmp_path: Path) -> None:
    make, _, hf_targets = CASES[family]
    model = make()
    hf = transformers_copy(model, tmp_path / "hf")
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=hf_targets, init_lora_weights=False)
    peft_model = peft.get_peft_model(hf, config).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    x = ids()
    theirs = hf_logits(peft_model, x)
    layers = model.load_adapter(tmp_path / "adapter", name="from_peft")
    assert model.active_adapter == "from_peft" and layers
    torch.testing.assert_close(logits(model, x), theirs, atol=1e-4, rtol=0)
    model.set_adapter(None)
    assert (logits(model, x) - theirs).abs().max() > 1e-2  # the adapter matters


def test_fused_c_attn_lora_becomes_q_k_v_loras_with_one_shared_a(tmp_path: Path) -> None:
    model = gpt2_like()
    hf = transformers_copy(model, tmp_path / "hf")
    peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=3, lora_alpha=6, target_modules=["c_attn"],
                                                         init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "fused")
    model.load_adapter(tmp_path / "fused")
    attn = model.layers[0].self_attn
    a = attn.q_proj.adapters["default"].lora_A
    assert attn.k_proj.adapters["default"].lora_A is a and attn.v_proj.adapters["default"].lora_A is a
    assert a.shape == (3, 16)
    # The shared A is one trainable parameter, as in peft; written back it is one rank-3 LoRA again.
    assert sum(p is a for p in model.parameters()) == 1
    model.save_adapter(tmp_path / "again")
    config = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert (config["r"], config["target_modules"], config["rank_pattern"]) == (3, ["c_attn"], {})
    from safetensors.torch import load_file

    original, written = load_file(tmp_path / "fused" / "adapter_model.safetensors"), load_file(
        tmp_path / "again" / "adapter_model.safetensors")
    assert original.keys() == written.keys()
    for key in original:
        torch.testing.assert_close(written[key], original[key], atol=0, rtol=0)


def test_separate_q_and_v_loras_are_written_block_diagonal_and_read_back_apart(tmp_path: Path) -> None:
    model = gpt2_like()
    fresh = copy.deepcopy(model)
    model.add_adapter(r=2, alpha=4, target_modules=["q_proj", "v_proj"])
    randomize_lora(model)
    x = ids()
    ours = logits(model, x)
    model.save_adapter(tmp_path / "qv")
    config = json.loads((tmp_path / "qv" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, ["c_attn"])  # rank 2 + 2

    fresh.load_adapter(tmp_path / "qv")
    attn = fresh.layers[0].self_attn
    assert isinstance(attn.q_proj, AdaptedLinear) and isinstance(attn.v_proj, AdaptedLinear)
    assert not isinstance(attn.k_proj, AdaptedLinear)  # its block of B is zero: no LoRA
    assert attn.q_proj.adapters["default"].r == 2
    torch.testing.assert_close(logits(fresh, x), ours, atol=1e-5, rtol=0)


def test_adapter_saved_on_a_base_model_loads_into_the_task_model(tmp_path: Path) -> None:
    """peft on ``BertModel`` names ``encoder.layer.0…``; the zoo's BERT exports as ``BertForMaskedLM`` (``bert.…``)."""
    model = bert_like()
    hf = transformers_copy(model, tmp_path / "hf").bert
    peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["query", "value"],
                                                         init_lora_weights=False)).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    x = ids()
    with torch.no_grad():
        hidden = peft_model(input_ids=x).last_hidden_state
    model.load_adapter(tmp_path / "adapter")
    with torch.no_grad():
        ours = model(x, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(ours, hidden, atol=1e-4, rtol=0)


def test_model_without_a_transformers_family_keeps_zoo_names_that_peft_applies_to_it(tmp_path: Path) -> None:
    model = gpt2_like(positional="alibi")  # no transformers family here has ALiBi
    fresh = copy.deepcopy(model)
    with pytest.raises(ValueError):
        to_transformers(model)
    model.add_adapter(r=2, target_modules=["q_proj", "down_proj"])
    randomize_lora(model)
    x = ids()
    ours = logits(model, x)
    model.save_adapter(tmp_path / "zoo")
    config = json.loads((tmp_path / "zoo" / "adapter_config.json").read_text())
    assert config["task_type"] is None and config["target_modules"] == ["down_proj", "q_proj"]
    fresh.load_adapter(tmp_path / "zoo")
    torch.testing.assert_close(logits(fresh, x), ours, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- bad files
def _peft_adapter(model: nn.Module, folder: Path, **config) -> Path:
    hf = transformers_copy(model, folder / "hf")
    peft.get_peft_model(hf, peft.LoraConfig(init_lora_weights=False, **config)).save_pretrained(folder / "adapter")
    return folder / "adapter"


def test_adapter_for_another_architecture_is_refused(tmp_path: Path) -> None:
    bert_adapter = _peft_adapter(bert_like(), tmp_path, r=2, target_modules=["query", "value"])
    model = gpt2_like()
    with pytest.raises(ValueError, match="does not have.*another architecture"):
        model.load_adapter(bert_adapter)
    assert model.adapter_names == [] and all(p.requires_grad for p in model.parameters())


def test_adapter_for_other_shapes_is_refused(tmp_path: Path) -> None:
    adapter = _peft_adapter(gpt2_like(d_model=32, d_ff=64), tmp_path, r=2, target_modules=["c_attn"])
    with pytest.raises(ValueError, match=r"\(96, 32\) weight.*\(48, 16\).*other shapes"):
        gpt2_like().load_adapter(adapter)


def test_unsupported_peft_features_are_named(tmp_path: Path) -> None:
    adapter = _peft_adapter(gpt2_like(), tmp_path, r=2, target_modules=["c_attn"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    for key, value, match in [("use_dora", True, "use_dora=True"), ("bias", "all", "bias='all'"),
                              ("peft_type", "IA3", "only 'LORA'")]:
        (adapter / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=match):
            gpt2_like().load_adapter(adapter)


def test_save_without_an_adapter_writes_nothing(tmp_path: Path) -> None:
    model = gpt2_like()
    with pytest.raises(ValueError, match="no active adapter"):
        model.save_adapter(tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()
    model.add_adapter(target_modules=["q_proj"], name="a")
    with pytest.raises(ValueError, match="no adapter named 'b'"):
        model.save_adapter(tmp_path / "nothing", name="b")
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        model.load_adapter(tmp_path, name="c")


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapters_follow_the_model_to_cuda_and_files_move_between_devices(dtype: torch.dtype, tmp_path: Path) -> None:
    cpu = gpt2_like()
    model = copy.deepcopy(cpu).to("cuda", dtype)
    model.add_adapter(r=4, alpha=8, target_modules="all-linear")
    lora = model.layers[0].self_attn.q_proj.adapters["default"]
    assert lora.lora_A.device.type == "cuda" and lora.lora_A.dtype == dtype
    randomize_lora(model)
    x = ids()
    on_gpu = logits(model, x.cuda()).float().cpu()
    x_ = model(x.cuda(), labels=x.cuda()).loss
    x_.backward()
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())
    model.save_adapter(tmp_path / "adapter")
    cpu.load_adapter(tmp_path / "adapter")
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(logits(cpu, x), on_gpu, atol=tolerance, rtol=0)
    model.merge_adapter()
    torch.testing.assert_close(logits(model, x.cuda()).float().cpu(), on_gpu, atol=tolerance, rtol=0)


def test_an_adapter_finds_its_family_among_those_that_represent_the_model(tmp_path: Path) -> None:
    """A RoBERTa-shaped encoder: peft's names (``roberta.encoder…``) pick the RoBERTa map, and ``model_type``
    chooses the family to write."""
    model = tiny_of("roberta")
    assert "roberta" in name_maps(model)
    save_transformers(model, tmp_path / "hf", "roberta")
    hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["query", "value"],
                                                         init_lora_weights=False)).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    x = ids()
    model.load_adapter(tmp_path / "adapter")
    torch.testing.assert_close(logits(model, x), hf_logits(peft_model, x), atol=1e-4, rtol=0)
    model.save_adapter(tmp_path / "back", model_type="roberta")
    from safetensors.torch import load_file

    assert load_file(tmp_path / "back" / "adapter_model.safetensors").keys() == load_file(
        tmp_path / "adapter" / "adapter_model.safetensors").keys()
    with pytest.raises(ValueError, match="'gpt2' cannot represent this EncoderLM"):
        model.save_adapter(tmp_path / "nowhere", model_type="gpt2")
    assert not (tmp_path / "nowhere").exists()


def test_writing_a_model_with_unmerged_adapters_is_refused(tmp_path) -> None:
    """save_pretrained / to_transformers would drop the adapter or store names no loader reads: refuse, name the fix."""
    model = DecoderLM.from_preset("llama-tiny").eval()
    model.add_adapter("lora", r=2, alpha=4, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="merge_and_unload"):
        model.save_pretrained(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ValueError, match="merge_and_unload"):
        to_transformers(model, "llama")
    model.merge_adapter()  # the weights now hold the adapter: the export computes what the model computes
    config, state = to_transformers(model, "llama")
    assert not any("lora" in key or "adapters" in key for key in state)
    model.merge_and_unload()
    model.save_pretrained(tmp_path / "ckpt")
    assert DecoderLM.from_pretrained(tmp_path / "ckpt").config == model.config
