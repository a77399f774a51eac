"""A LoRA trained with its task head, saved in the ``peft`` layout with the head as ``modules_to_save``: ``peft``
loads it onto the ``transformers`` task class and computes the zoo's logits; the zoo reads it back, and reads what
``peft`` itself saves."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import models
from models import DecoderLM, DecoderLMConfig, EncoderLM, EncoderLMConfig
from models.convert import save_transformers

ATOL = 1e-4
ENCODER = dict(vocab_size=60, d_model=24, n_heads=2, d_ff=40, n_layers=2, max_len=32, dropout=0.0, pad_token_id=0)
DECODER = dict(ENCODER, norm="rmsnorm", norm_eps=1e-5, ffn="swiglu", positional="rotary", sublayer="pre_norm",
               bias=False, tie_embeddings=False)
CASES = {
    "bert": (EncoderLM, EncoderLMConfig, ENCODER, {"pre_classifier": "bert"}, "BertForSequenceClassification",
             ["bert.pooler.dense", "classifier"]),
    "llama": (DecoderLM, DecoderLMConfig, DECODER, {"pooling": "last", "classifier_bias": False},
              "LlamaForSequenceClassification", ["score"]),
}


def trained(family: str, tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    """A classifier exported as its base checkpoint, then given a LoRA and a trainable head with changed weights
    (as training leaves them)."""
    cls, config_class, fields, options, _, _ = CASES[family]
    torch.manual_seed(0)
    model = cls(config_class(**fields, head="sequence_classification",
                             options={"head": {"num_labels": 3, "classifier_dropout": 0.0, **options}})).eval()
    save_transformers(model, tmp_path / "base", model_type=family)
    model.add_adapter(r=2, alpha=4, target_modules=["q_proj", "v_proj"])
    model.head.requires_grad_(True)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model, tmp_path / "base"


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    return ids.masked_fill(~mask.bool(), 0), mask


@pytest.mark.parametrize("family", list(CASES))
@torch.no_grad()
def test_peft_loads_the_lora_and_head_onto_transformers(family: str, tmp_path: Path) -> None:
    model, base = trained(family, tmp_path)
    model.save_adapter(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    _, _, _, _, hf_class, saved = CASES[family]
    assert config["modules_to_save"] == saved and config["task_type"] == "SEQ_CLS"
    assert {k for k in load_file(tmp_path / "adapter" / "adapter_model.safetensors") if "lora_" not in k} == {
        f"base_model.model.{m}.{p}" for m in saved for p in (("weight", "bias") if family == "bert" else ("weight",))}

    ids, mask = inputs()
    expected = model(ids, mask.bool()).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = getattr(transformers, hf_class).from_pretrained(base).float().eval()
        reference = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    position = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)} if family == "llama" else {}
    torch.testing.assert_close(reference(input_ids=ids, attention_mask=mask, **position).logits, expected,
                               atol=ATOL, rtol=0)

    again = models.from_pretrained(base)
    again.load_adapter(tmp_path / "adapter")
    torch.testing.assert_close(again.eval()(ids, mask.bool()).logits, expected, atol=1e-5, rtol=0)
    assert all(p.requires_grad for p in again.head.parameters())  # saved modules stay trainable, as in peft


@torch.no_grad()
def test_zoo_reads_an_adapter_that_peft_saved_with_the_classifier(tmp_path: Path) -> None:
    _, base = trained("bert", tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.BertForSequenceClassification.from_pretrained(base).float().eval()
    tuned = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"],
                                                    modules_to_save=["classifier"], task_type="SEQ_CLS"))
    gen = torch.Generator().manual_seed(3)
    for p in tuned.parameters():
        if p.requires_grad:  # the LoRA and peft's copy of the classifier
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    tuned.save_pretrained(tmp_path / "peft")
    ids, mask = inputs()
    zoo = models.from_pretrained(base)
    zoo.load_adapter(tmp_path / "peft")
    torch.testing.assert_close(zoo.eval()(ids, mask.bool()).logits, tuned.eval()(input_ids=ids, attention_mask=mask)
                               .logits, atol=ATOL, rtol=0)


def test_bad_saved_modules_raise(tmp_path: Path) -> None:
    model, base = trained("bert", tmp_path)
    model.save_adapter(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    lm = EncoderLM(EncoderLMConfig(**ENCODER))
    with pytest.raises(ValueError, match="modules_to_save=.*does not implement for this EncoderLM with the 'mlm' head"):
        lm.load_adapter(tmp_path / "adapter")
    tensors = load_file(weights)
    tensors["base_model.model.bert.encoder.layer.0.output.dense.weight"] = torch.zeros(24, 40)
    save_file(tensors, weights)
    with pytest.raises(ValueError, match="output.dense.weight'\\], which are not modules of this EncoderLM's"):
        models.from_pretrained(base).load_adapter(tmp_path / "adapter")
    with torch.no_grad():
        wrong = EncoderLM(EncoderLMConfig(**ENCODER, head="sequence_classification",
                                          options={"head": {"num_labels": 4, "pre_classifier": "bert"}}))
    del tensors["base_model.model.bert.encoder.layer.0.output.dense.weight"]
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"saved 'head.classifier.\w+' has shape \(3.*but this model's head has \(4"):
        wrong.load_adapter(tmp_path / "adapter")
    both = EncoderLM(EncoderLMConfig(**ENCODER, head="sequence_classification", options={"head": {"num_labels": 3}}))
    both.add_adapter(r=2, target_modules="all-linear")
    both.head.requires_grad_(True)
    with pytest.raises(ValueError, match="the task head is trained and saved whole, but the adapter also adapts it"):
        both.save_adapter(tmp_path / "both")
