"""QLoRA: LoRA adapters beside quantized layers whose packed weights stay packed and frozen.

The references are independent of the adapted quantized layer: ``F.linear`` on the unpacked weight (for outputs and
input gradients), the float model holding the dequantized weights with the same adapter loaded from the saved files,
and ``peft``'s ``PeftModel`` on the ``transformers`` export of that float model."""

from __future__ import annotations

import copy
import json
import logging
import warnings
from functools import partial
from pathlib import Path

import peft
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers

import blocks
from blocks.adapters import AdaptedLinear, AdaptedQuantizedLinear
from blocks.quantized import Int8Linear, QuantizedLinear, packable_schemes
from models import DecoderLM
from models.convert import save_transformers
from tests.serving.test_engine_quantized import quantize_tied
from training import CausalLMCollator, Trainer, TrainerConfig

VOCAB = 40
TARGETS = ["q_proj", "v_proj"]


def float_model(seed: int = 0) -> DecoderLM:
    """A GPT-2-like tiny model (tied head), weights scaled up so that int8 rounding and adapters show."""
    torch.manual_seed(seed)
    model = DecoderLM.from_preset("tiny", vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0,
                                  max_len=32, pad_token_id=0).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model


def ids(batch: int = 2, length: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model: DecoderLM, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


def randomize_lora(model: DecoderLM, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def packed_state(model: DecoderLM) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if ".adapters." not in k}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # peft: "fan_in_fan_out is set to False but ... Conv1D"
        warnings.simplefilter("ignore", FutureWarning)  # transformers: is_gradient_checkpointing
        yield


@pytest.mark.parametrize("scheme", packable_schemes())
def test_adapted_layer_output_and_input_gradient_follow_the_unpacked_weight(
    scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward = ``F.linear`` on the unpacked weight + the LoRA; the input gradient comes from the unpacked weight
    (``CHUNK_ELEMENTS`` shrunk so that it is unpacked in several pieces) even when the packed forward has no
    derivative (simulated by a forward whose output is detached: the adapter's input gradient alone would remain)."""
    torch.manual_seed(0)
    base = blocks.get("quantization", scheme).from_float(torch.randn(48, 256), torch.randn(48))
    layer = AdaptedQuantizedLinear(base)
    layer.adapters["a"] = blocks.build("adapter", "lora", in_features=256, out_features=48, r=4)
    layer.active = "a"
    with torch.no_grad():
        layer.adapters["a"].lora_B.normal_()
    lora = layer.adapters["a"]
    monkeypatch.setattr(blocks.adapters, "CHUNK_ELEMENTS", 256 * 10)
    plain_linear = type(base).linear
    monkeypatch.setattr(type(base), "linear", lambda self, x: plain_linear(self, x).detach())
    x = torch.randn(3, 5, 256, requires_grad=True)
    ours = layer(x)
    x_ref = x.detach().clone().requires_grad_(True)
    weight = base.unpack()
    reference = F.linear(x_ref, weight, base.bias) + (x_ref @ lora.lora_A.T @ lora.lora_B.T) * lora.scaling
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-4)
    g = torch.randn_like(ours)
    ours.backward(g)
    reference.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-4)
    assert lora.lora_A.grad is not None and base.bias.grad is None
    assert not any(t.requires_grad for t in base.buffers())


def test_trainer_steps_train_only_the_float32_adapter_on_the_packed_frozen_base(tmp_path: Path) -> None:
    model = quantize_tied(float_model())  # int8 layers, and the embedding packed as the head's table
    adapted = model.add_adapter(r=4, alpha=8, target_modules=TARGETS)
    assert adapted == [f"layers.{i}.self_attn.{p}" for i in range(2) for p in TARGETS]
    layer = model.layers[0].self_attn.q_proj
    assert isinstance(layer, AdaptedQuantizedLinear) and isinstance(layer.base, Int8Linear)
    assert layer.adapters["default"].lora_A.dtype == torch.float32
    before = packed_state(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"layers.{i}.self_attn.{p}.adapters.default.lora_{ab}" for i in range(2) for p in TARGETS
                         for ab in "AB"}
    # One gradient by hand: only the adapter's parameters get one.
    model.train()
    model(ids(4, 8), labels=ids(4, 8)).loss.backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == trainable
    model.zero_grad(set_to_none=True)
    # One row to learn by heart (the base model's predictions of it are poor: a loss near log(VOCAB) = 3.7).
    rows = [list(range(10, 20))] * 32
    config = TrainerConfig(max_steps=10, batch_size=8, progress=False, device="cpu", seed=0)
    trainer = Trainer(model, partial(torch.optim.AdamW, lr=3e-2), config, rows, CausalLMCollator(pad_token_id=0))
    history = trainer.train()
    assert {id(p) for group in trainer.optimizer.param_groups for p in group["params"]} == {
        id(p) for n, p in model.named_parameters() if n in trainable}
    first, last = history[0]["loss"], sum(h["loss"] for h in history[-3:]) / 3
    assert last < 0.6 * first, [round(h["loss"], 3) for h in history]
    after = packed_state(model)
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert model.layers[1].self_attn.v_proj.base.weight_int8.dtype == torch.int8


def test_saved_adapter_has_the_float_model_names_and_gives_the_quantized_logits_on_the_dequantized_model(
    tmp_path: Path,
) -> None:
    quantized = quantize_tied(float_model())
    dequantized = copy.deepcopy(quantized).dequantize()  # float weights = the unpacked packed weights
    assert not any(isinstance(m, QuantizedLinear) for m in dequantized.modules())
    quantized.add_adapter(r=4, alpha=8, target_modules=TARGETS)
    randomize_lora(quantized)
    x = ids()
    ours = logits(quantized, x)
    quantized.save_adapter(tmp_path / "qlora", base_model="tiny-base")

    # The same adapter on the float model writes the same file: names, config, tensors.
    twin = float_model()
    twin.add_adapter(r=4, alpha=8, target_modules=TARGETS)
    trained = dict(quantized.named_parameters())
    with torch.no_grad():
        for n, p in twin.named_parameters():
            if "lora_" in n:
                p.copy_(trained[n])
    twin.save_adapter(tmp_path / "float", base_model="tiny-base")
    read = {kind: safetensors.torch.load_file(tmp_path / kind / "adapter_model.safetensors") for kind in ("qlora",
                                                                                                          "float")}
    assert sorted(read["qlora"]) == sorted(read["float"]) == [
        f"base_model.model.transformer.h.{i}.attn.c_attn.lora_{ab}.weight" for i in range(2) for ab in "AB"]
    assert all(torch.equal(read["qlora"][k], read["float"][k]) for k in read["float"])
    configs = [json.loads((tmp_path / kind / "adapter_config.json").read_text()) for kind in ("qlora", "float")]
    assert configs[0] == configs[1] and configs[0]["target_modules"] == ["c_attn"]

    # Loaded onto the float model of the dequantized weights: the quantized + adapter logits.
    dequantized.load_adapter(tmp_path / "qlora")
    assert isinstance(dequantized.layers[0].self_attn.q_proj, AdaptedLinear)
    quantized.set_adapter(None)
    assert (ours - logits(quantized, x)).abs().max() > 1e-2  # the adapter matters
    quantized.set_adapter("default")
    torch.testing.assert_close(logits(dequantized, x), ours, rtol=0, atol=1e-4)

    # peft's PeftModel on the transformers export of that float model: the same logits again.
    dequantized.set_adapter(None)
    save_transformers(copy.deepcopy(dequantized).merge_and_unload(), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "qlora").eval()(input_ids=x).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)

    # And back: the adapter the float model saves loads onto the quantized model (float32, beside packed layers).
    fresh = quantize_tied(float_model())
    fresh.load_adapter(tmp_path / "float")
    assert isinstance(fresh.layers[1].self_attn.v_proj, AdaptedQuantizedLinear)
    torch.testing.assert_close(logits(fresh, x), ours, rtol=0, atol=1e-6)


def test_merge_is_refused_on_packed_weights_and_allowed_after_dequantize() -> None:
    model = quantize_tied(float_model())
    model.add_adapter(r=4, target_modules=TARGETS)
    randomize_lora(model)
    x = ids()
    adapted = logits(model, x)
    before = packed_state(model)
    for merge in (model.merge_adapter, model.merge_and_unload):
        with pytest.raises(ValueError, match=r"cannot merge adapter 'default': it adapts 'layers\.0\.self_attn\."
                                             r"q_proj' and 3 more, quantized as 'int8'.*model\.dequantize\(\)"):
            merge()
    assert torch.equal(logits(model, x), adapted)  # nothing changed
    assert all(torch.equal(v, packed_state(model)[k]) for k, v in before.items())
    assert model.active_adapter == "default" and not any(
        getattr(m, "merged", None) for m in model.modules())

    # Dequantized, the base layers are float and the adapter merges into them.
    float_copy = copy.deepcopy(model).dequantize()
    torch.testing.assert_close(logits(float_copy, x), adapted, rtol=0, atol=1e-4)
    float_copy.merge_adapter()
    assert float_copy.layers[0].self_attn.q_proj.merged == "default"
    torch.testing.assert_close(logits(float_copy, x), adapted, rtol=0, atol=1e-4)

    # Without an active adapter the adapters drop and the packed model remains as it was.
    model.set_adapter(None)
    plain = model.merge_and_unload()
    assert isinstance(plain.layers[0].self_attn.q_proj, Int8Linear) and not plain.adapter_names
    torch.testing.assert_close(logits(plain, x), logits(quantize_tied(float_model()), x), rtol=0, atol=0)


def test_targets_on_a_quantized_model_are_the_float_model_targets_and_the_tied_head_is_refused() -> None:
    model = quantize_tied(float_model())
    assert model.add_adapter(target_modules="all-linear", name="all") == float_model().add_adapter(
        target_modules="all-linear", name="all")
    assert "embed_tokens.table" not in model.add_adapter(target_modules=r"layers\..*", name="every")
    with pytest.raises(ValueError, match=r"cannot adapt 'lm_head': its weight is tied to \['embed_tokens'\]"):
        model.add_adapter(target_modules=["lm_head"], name="head")
    # A second adapter on an adapted quantized layer sits beside the first.
    model.add_adapter(r=2, target_modules=["q_proj"], name="second")
    assert sorted(model.layers[0].self_attn.q_proj.adapters) == ["all", "every", "second"]
