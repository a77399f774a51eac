"""Quantized models on disk and on the Hub: int8 checkpoints save, load and push bit-identically; dequantize.

References: the safetensors header is read as raw JSON (dtype and byte range of every tensor, independent of torch);
the dequantized weights are checked against the formula ``scale[o] · q[o, i]``; logits of reloaded models are
compared with ``torch.equal`` against the model that was saved.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import blocks
from blocks.quantized import Int8Linear, check_unquantized, quantization_options, quantize_linears, quantized_modules
from models import DecoderLM, DecoderLMConfig, EncoderLM, EncoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer, auto
from models.checkpoints import atomic, persistence
from tests.hub.conftest import hub  # noqa: F401  (the in-process Hub fixture)
from tests.hub.hub_server import HubServer

SMALL = dict(vocab_size=64, d_model=32, n_heads=4, d_ff=64, max_len=32, dropout=0.0)
FAMILIES = ["decoder", "encoder", "seq2seq"]
IDS = torch.randint(4, 64, (2, 9), generator=torch.Generator().manual_seed(1))


def tiny(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    torch.manual_seed(seed)
    if family == "decoder":
        return DecoderLM(DecoderLMConfig(**SMALL, n_layers=2, **overrides)).eval()
    if family == "encoder":
        return EncoderLM(EncoderLMConfig(**SMALL, n_layers=1, **overrides)).eval()
    return Seq2SeqTransformer(Seq2SeqConfig(**SMALL, n_encoder_layers=1, n_decoder_layers=1, **overrides)).eval()


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(model, Seq2SeqTransformer):
            return model(IDS, IDS[:, :5]).logits
        return model(IDS).logits


def header(path: Path) -> dict[str, Any]:
    """The safetensors header as written: name -> {dtype, shape, data_offsets} (read without safetensors/torch)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return {k: v for k, v in json.loads(f.read(length)).items() if k != "__metadata__"}


def config_json(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def edit_config(folder: Path, **changes: Any) -> None:
    raw = config_json(folder)
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("family", FAMILIES)
def test_int8_checkpoint_reloads_bit_identically(family: str, tmp_path: Path) -> None:
    model = tiny(family).quantize("int8")
    layers = quantized_modules(model)
    assert set(layers.values()) == {"int8"} and ("lm_head" in layers or "mlm_head.decoder" in layers)
    folder = model.save_pretrained(tmp_path / "q")

    # One byte per weight: every quantized layer is stored as I8 of out x in bytes, a float32 scale per row, and
    # no float weight; the tied embedding stays float.
    tensors = header(folder / "model.safetensors")
    for name in layers:
        layer = model.get_submodule(name)
        start, end = tensors[f"{name}.weight_int8"]["data_offsets"]
        assert tensors[f"{name}.weight_int8"]["dtype"] == "I8"
        assert end - start == layer.out_features * layer.in_features
        start, end = tensors[f"{name}.scale"]["data_offsets"]
        assert tensors[f"{name}.scale"]["dtype"] == "F32" and end - start == 4 * layer.out_features
        assert f"{name}.weight" not in tensors
    embedding = "embed_tokens.weight" if family != "seq2seq" else "src_embed.weight"
    assert tensors[embedding]["dtype"] == "F32"

    raw = config_json(folder)
    assert raw["quantization"] == {"scheme": "int8", "modules": list(layers)}
    assert type(model).config_class.from_dict(raw["config"]) == model.config
    assert "quantized as `int8`" in (folder / "README.md").read_text()

    loaded = type(model).from_pretrained(folder)
    assert quantized_modules(loaded) == layers
    assert loaded.config == model.config
    saved, back = model.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys()
    assert all(saved[k].dtype == back[k].dtype and torch.equal(saved[k], back[k]) for k in saved)
    assert torch.equal(logits(loaded), logits(model))
    assert torch.equal(logits(auto.from_pretrained(folder)), logits(model))
    if family == "decoder":
        prompt = IDS[:, :4]
        assert torch.equal(
            loaded.generate(prompt, max_new_tokens=5, eos_token_id=None),
            model.generate(prompt, max_new_tokens=5, eos_token_id=None),
        )


@pytest.mark.parametrize("tie", [True, False])
def test_head_tied_to_the_embedding_gets_its_own_int8_copy_that_survives_a_reload(tie: bool, tmp_path: Path) -> None:
    model = tiny("decoder", tie_embeddings=tie)
    embedding = model.embed_tokens.weight.detach().clone()
    head = model.lm_head.weight.detach().clone()
    model.quantize("int8")
    # The head is quantized from the weights it had (the embedding's when tied); the embedding keeps its floats.
    # torchao's symmetric int8 (Int8WeightOnlyConfig): scale = max|w| / 127.5, q = round(w / scale) in [-128, 127].
    expected = torch.round(head * (1.0 / (head.abs().amax(1, keepdim=True) / 127.5))).clamp(-128, 127).to(torch.int8)
    assert torch.equal(model.lm_head.weight_int8, expected)
    assert torch.equal(model.embed_tokens.weight, embedding)

    loaded = DecoderLM.from_pretrained(model.save_pretrained(tmp_path / "q"))
    assert isinstance(loaded.lm_head, Int8Linear) and loaded.config.tie_embeddings is tie
    assert torch.equal(loaded.lm_head.weight_int8, expected)
    assert torch.equal(loaded.embed_tokens.weight, embedding)
    assert torch.equal(logits(loaded), logits(model))


def test_partly_quantized_model_reloads_with_the_same_layers(tmp_path: Path) -> None:
    model = tiny("decoder")
    chosen = ["layers.1.ffn.down_proj", "layers.0.self_attn.q_proj"]
    quantize_linears(model, "int8", modules=chosen)
    folder = model.save_pretrained(tmp_path / "q")
    assert config_json(folder)["quantization"]["modules"] == sorted(chosen, key=list(dict(model.named_modules())).index)
    loaded = DecoderLM.from_pretrained(folder)
    assert sorted(quantized_modules(loaded)) == sorted(chosen)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight  # the untouched head is still tied
    assert torch.equal(logits(loaded), logits(model))


def test_any_saved_model_class_round_trips_its_quantized_layers(tmp_path: Path) -> None:
    # The vision transformer has no quantize() method; quantize_linears and the checkpoint path are generic.
    from models.vit import VisionTransformer

    model = VisionTransformer.from_preset("tiny").eval()
    quantize_linears(model, "int8")
    loaded = VisionTransformer.from_pretrained(model.save_pretrained(tmp_path / "vit"))
    assert quantized_modules(loaded) == quantized_modules(model) and len(quantized_modules(model)) > 0
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(pixels).logits, model(pixels).logits)


def test_int8_checkpoint_loaded_as_bfloat16_runs_with_aligned_int8_weights(tmp_path: Path) -> None:
    # safetensors returns views at 8-byte offsets of one buffer; the CPU int8 kernel's bfloat16 path segfaults on an
    # int8 weight that is not 64-byte aligned, so the loader copies such weights into aligned memory.
    model = tiny("decoder").quantize("int8")
    loaded = DecoderLM.from_pretrained(model.save_pretrained(tmp_path / "q"), dtype="bfloat16")
    assert all(m.weight_int8.data_ptr() % 64 == 0 for m in loaded.modules() if isinstance(m, Int8Linear))
    assert torch.equal(logits(loaded), logits(model.to(torch.bfloat16)))


def test_push_and_pull_a_quantized_model(hub: HubServer) -> None:  # noqa: F811
    model = tiny("decoder").quantize("int8")
    model.push_to_hub("tester/int8")
    pulled = DecoderLM.from_pretrained("tester/int8")
    assert quantized_modules(pulled) == quantized_modules(model)
    assert torch.equal(logits(pulled), logits(model))
    model.push_to_hub("tester/int8")  # same bytes again (deterministic file and config): no second commit
    assert hub.count("POST", "/commit/") == 1


def test_a_failed_save_of_the_quantized_model_leaves_the_float_checkpoint(tmp_path: Path, monkeypatch) -> None:
    model = tiny("decoder")
    float_logits = logits(model)
    folder = model.save_pretrained(tmp_path / "ckpt")

    def fail(label: str) -> None:
        if label == "fsync staging folder":  # every file written and synced, not yet committed
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(atomic, "step_hook", fail)
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.quantize("int8").save_pretrained(folder)
    assert "quantization" not in config_json(folder)
    assert torch.equal(logits(DecoderLM.from_pretrained(folder)), float_logits)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the staging folder is gone
    monkeypatch.setattr(atomic, "step_hook", None)
    model.save_pretrained(folder)
    assert torch.equal(logits(DecoderLM.from_pretrained(folder)), logits(model))


# ------------------------------------------------------------------------------------------ dequantize
@pytest.mark.parametrize("family", FAMILIES)
def test_dequantize_gives_float_layers_holding_scale_times_q(family: str, tmp_path: Path) -> None:
    model = tiny(family).quantize("int8")
    quantized_logits = logits(model)
    int8 = {name: (m.weight_int8.clone(), m.scale.clone()) for name, m in model.named_modules()
            if isinstance(m, Int8Linear)}
    assert model.dequantize() is model
    assert not quantized_modules(model)
    for name, (q, scale) in int8.items():
        layer = model.get_submodule(name)
        assert type(layer) is nn.Linear and layer.weight.dtype == torch.float32
        assert torch.equal(layer.weight, q.float() * scale[:, None])
    # Same function up to float rounding: (x·qᵀ)·s vs x·(s·q)ᵀ.
    dequantized_logits = logits(model)
    assert torch.allclose(dequantized_logits, quantized_logits, rtol=1e-5, atol=1e-5 * quantized_logits.abs().max())
    # The head no longer shares the embedding's weights, and the config says so: the model saves and reloads.
    assert model.config.tie_embeddings is False
    loaded = type(model).from_pretrained(model.save_pretrained(tmp_path / "d"))
    assert "quantization" not in config_json(tmp_path / "d")
    assert torch.equal(logits(loaded), dequantized_logits)
    # Quantizing the dequantized weights again gives back the int8 values within one step (not always the same: a
    # row holding -128 gets max|w| = 128 · scale, so its new scale is 128 / 127.5 of the old one).
    model.quantize("int8")
    for name, (q, scale) in int8.items():
        assert (model.get_submodule(name).weight_int8.int() - q.int()).abs().max() <= 1
        assert torch.allclose(model.get_submodule(name).scale, scale, rtol=128 / 127.5 - 1 + 1e-6, atol=0)


def test_dequantize_keeps_a_head_tie_that_quantization_did_not_break() -> None:
    model = tiny("decoder")
    quantize_linears(model, "int8", modules=["layers.0.ffn.up_proj"])
    model.dequantize()
    assert model.config.tie_embeddings is True and model.lm_head.weight is model.embed_tokens.weight


# ------------------------------------------------------------------------------------------ mismatches
def test_int8_weights_into_an_unquantized_model_name_the_scheme(tmp_path: Path) -> None:
    quantized = tiny("decoder").quantize("int8")
    with pytest.raises(ValueError, match=r"quantized as 'int8'.*unquantized nn\.Linear.*model\.quantize\('int8'\)"):
        auto.load_state_into(tiny("decoder"), quantized.state_dict())
    folder = quantized.save_pretrained(tmp_path / "q")
    edit_config(folder, quantization=None)  # the record is lost: the weights alone tell what they are
    with pytest.raises(ValueError, match=r"layer\(s\) quantized as 'int8'"):
        DecoderLM.from_pretrained(folder)


def test_float_weights_into_a_quantized_model_name_the_scheme(tmp_path: Path) -> None:
    plain = tiny("decoder")
    with pytest.raises(ValueError, match=r"float weights, not the quantized tensors .*quantized as 'int8'.*dequantize"):
        auto.load_state_into(tiny("decoder").quantize("int8"), plain.state_dict())
    folder = plain.save_pretrained(tmp_path / "f")
    edit_config(folder, quantization={"scheme": "int8", "modules": ["lm_head"]})
    # The tied head is stored once, as the embedding: the checkpoint has no lm_head tensor at all.
    with pytest.raises(ValueError, match=r"\(lm_head\.weight_int8, lm_head\.scale, \.\.\.\), for 1 layer\(s\) that the "
                                         r"DecoderLM has quantized as 'int8'"):
        DecoderLM.from_pretrained(folder)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"scheme": "int3", "modules": ["lm_head"]}, r"scheme 'int3'; this transformer-zoo knows \[.*'int4', 'int8'"),
        ({"scheme": "int8"}, r"keys \['modules', 'scheme'\], got \['scheme'\]"),
        ("int8", r"keys \['modules', 'scheme'\], got 'int8'"),
        ({"scheme": "int8", "modules": []}, r"non-empty strings\), got \[\]"),
        ({"scheme": "int8", "modules": "lm_head"}, r"got 'lm_head'"),
        ({"scheme": "int8", "modules": ["lm_head", "lm_head"]}, r"more than once: \['lm_head'\]"),
    ],
)
def test_malformed_quantization_entries_fail_before_the_weights_are_read(entry, match, tmp_path: Path) -> None:
    folder = tiny("decoder").quantize("int8").save_pretrained(tmp_path / "q")
    edit_config(folder, quantization=entry)
    (folder / "model.safetensors").unlink()  # read first, a missing file would be the error
    with pytest.raises(ValueError, match=match):
        DecoderLM.from_pretrained(folder)


def test_quantization_entry_naming_a_layer_that_is_not_linear(tmp_path: Path) -> None:
    folder = tiny("decoder").quantize("int8").save_pretrained(tmp_path / "q")
    edit_config(folder, quantization={"scheme": "int8", "modules": ["lm_head", "norm", "nope"]})
    with pytest.raises(ValueError, match=r"'quantization' entry does not fit DecoderLM: cannot quantize nope, "
                                         r"norm: not nn\.Linear or nn\.Embedding layers"):
        DecoderLM.from_pretrained(folder)


@pytest.mark.parametrize("stored", [torch.int16, torch.float32])
def test_int8_weights_stored_in_another_dtype_are_refused(stored: torch.dtype, tmp_path: Path) -> None:
    folder = tiny("decoder").quantize("int8").save_pretrained(tmp_path / "q")
    state = load_file(folder / "model.safetensors")
    state["lm_head.weight_int8"] = state["lm_head.weight_int8"].to(stored)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"lm_head\.weight_int8: checkpoint dtype {stored} vs model dtype torch.int8"):
        DecoderLM.from_pretrained(folder)


def test_check_unquantized_names_the_scheme_and_the_fix() -> None:
    check_unquantized(tiny("decoder"), "export to transformers")  # a float model passes
    model = tiny("decoder").quantize("int8")
    expected = r"cannot export to transformers: this DecoderLM has 13 layer\(s\) quantized as 'int8' \(layers\.0\."
    with pytest.raises(ValueError, match=expected + r".*call model\.dequantize\(\) first"):
        check_unquantized(model, "export to transformers")
    check_unquantized(model.dequantize(), "export to transformers")


def test_export_to_transformers_of_a_quantized_model_names_the_fix(tmp_path: Path) -> None:
    from models.convert.export import save_transformers

    with pytest.raises(ValueError, match=r"quantized as 'int8'.*model\.dequantize\(\)"):
        save_transformers(tiny("decoder").quantize("int8"), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------------------------ bad input
class Differs(Int8Linear):
    """An int8 layer claiming an option ``n`` (to give two layers of one scheme different options)."""

    scheme = "differs"

    def __init__(self, n: int) -> None:
        super().__init__(4, 2)
        self._options = {"n": n}


def test_bad_input(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="has no quantized layers to dequantize"):
        tiny("decoder").dequantize()
    model = tiny("decoder")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"cannot quantize layers\.9\.nope, norm: not nn\.Linear layers"):
        quantize_linears(model, "int8", modules=["lm_head", "norm", "layers.9.nope"])
    with pytest.raises(ValueError, match="modules must be a collection of module names, got 'lm_head'"):
        quantize_linears(model, "int8", modules="lm_head")
    assert not quantized_modules(model)  # nothing was changed by the refused calls
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="to_linear needs a floating dtype, got torch.int8"):
        blocks.get("quantization", "int8").from_linear(nn.Linear(4, 2)).to_linear(torch.int8)
    # One checkpoint records one set of options per scheme: layers of one scheme with two are refused before
    # anything is written.
    model.quantize("int8")
    monkeypatch.setattr(persistence, "quantization_options",
                        lambda m: quantization_options(nn.ModuleList([Differs(1), Differs(2)])))
    with pytest.raises(ValueError, match=r"layers quantized as 'differs' with different options"):
        model.save_pretrained(tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()
