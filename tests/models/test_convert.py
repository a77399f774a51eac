"""Loading ``transformers`` checkpoints (GPT-2, BERT, Marian, BART) into zoo models, and exporting them back.

Every checkpoint is a randomly initialised ``transformers`` model with a tiny config, its weights perturbed
(so that no parameter keeps a symmetric initial value such as LayerNorm's ones or a zero bias), saved with
``save_pretrained`` and loaded by ``models.auto.from_pretrained`` (or read back and converted directly).
Padded inputs are right-padded: ``transformers`` numbers positions 0..L-1 whatever the mask, the zoo counts
real tokens, and the two agree on every real token of a right-padded row, which is where logits are compared.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # a dev dependency: missing, the suite must fail here, not skip
from safetensors.torch import load_file
from torch import Tensor, nn

import models
import models.auto
from models.convert import (
    Converted,
    from_transformers,
    register_converter,
    save_transformers,
    supported_model_types,
    to_transformers,
)

ATOL = 1e-4
VOCAB = 99

# Small configs of each family; the test adds overrides on top.
GPT2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=1, eos_token_id=2)
BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=32)
SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=32)
MARIAN = dict(SEQ2SEQ, pad_token_id=VOCAB - 1, decoder_start_token_id=VOCAB - 1, eos_token_id=0)
BART = dict(SEQ2SEQ, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # model_type: (transformers config class, task model class, base config)
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", GPT2),
    "bert": ("BertConfig", "BertForMaskedLM", BERT),
    "marian": ("MarianConfig", "MarianMTModel", MARIAN),
    "bart": ("BartConfig", "BartForConditionalGeneration", BART),
}


# ---------------------------------------------------------------------------------------------- helpers
def build_hf(model_type: str, model_class: str | None = None, **overrides: Any) -> nn.Module:
    """A ``transformers`` model of the family with perturbed weights, in eval mode."""
    config_class, default_class, base = FAMILIES[model_type]
    config = getattr(transformers, config_class)(**{**base, **overrides})
    model = getattr(transformers, model_class or default_class)(config)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # Marian's sinusoid table is a frozen parameter and must stay as it is
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.normal_(std=0.2, generator=gen)
    return model.eval()


def save(model: nn.Module, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    return json.loads((path / "config.json").read_text()), load_file(path / "model.safetensors")


def instantiate(converted: Converted) -> nn.Module:
    """The zoo model with the converted weights (keys outside ``allow_missing`` all present)."""
    model = converted.architecture(converted.config)
    result = model.load_state_dict(converted.state_dict, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= converted.allow_missing
    return model.eval()


def load_zoo(path: Path) -> nn.Module:
    """The checkpoint folder through the zoo's loader (``config.json`` with ``model_type`` -> conversion)."""
    return models.auto.from_pretrained(path)


def inputs(length: int = 7, pad: int = 2, seed: int = 0, batch: int = 2) -> tuple[Tensor, Tensor]:
    """``(ids (batch, length), mask)``; row 1 is right-padded by ``pad`` positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB - 1, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, length - pad:] = False
    return ids, mask


def assert_close_on(mask: Tensor, expected: Tensor, actual: Tensor) -> None:
    assert expected.shape == actual.shape
    torch.testing.assert_close(actual[mask], expected[mask], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- logits parity
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": False, "activation_function": "relu", "n_inner": 40, "layer_norm_epsilon": 1e-6},
        {"reorder_and_upcast_attn": True, "activation_function": "gelu_pytorch_tanh"},
    ],
    ids=["default", "untied-relu-ninner", "reorder-upcast"],
)
def test_gpt2_logits_match_transformers(tmp_path: Path, overrides: dict[str, Any]) -> None:
    hf = build_hf("gpt2", **overrides)
    zoo = load_zoo(save(hf, tmp_path))
    assert isinstance(zoo, models.DecoderLM)
    ids, mask = inputs()
    with torch.no_grad():
        assert_close_on(mask, hf(ids, attention_mask=mask.long()).logits, zoo(ids, attention_mask=mask).logits)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": False, "type_vocab_size": 3, "layer_norm_eps": 1e-7}],
    ids=["default", "untied-3-segments"],
)
def test_bert_mlm_logits_match_transformers(tmp_path: Path, overrides: dict[str, Any]) -> None:
    hf = build_hf("bert", **overrides)
    zoo = load_zoo(save(hf, tmp_path))
    assert isinstance(zoo, models.EncoderLM)
    ids, mask = inputs()
    segments = torch.randint(0, hf.config.type_vocab_size, ids.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask.long(), token_type_ids=segments).logits
        assert_close_on(mask, expected, zoo(ids, attention_mask=mask, token_type_ids=segments).logits)


def seq2seq_logits(hf: nn.Module, zoo: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
    src, src_mask = inputs(7, pad=2, seed=1)
    tgt, tgt_mask = inputs(5, pad=1, seed=2)
    tgt_mask = tgt_mask.flip(0)  # pad the other row on the target side
    with torch.no_grad():
        expected = hf(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt,
                      decoder_attention_mask=tgt_mask.long()).logits
        actual = zoo(src, tgt, src_mask=src_mask, tgt_mask=tgt_mask).logits
    return tgt_mask, expected, actual


@pytest.mark.parametrize(
    "overrides",
    [
        {"scale_embedding": True, "activation_function": "swish"},
        {"tie_word_embeddings": False},
        {"share_encoder_decoder_embeddings": False, "activation_function": "relu"},
    ],
    ids=["opus-mt-like", "untied", "separate-vocab-matrices"],
)
def test_marian_logits_match_transformers(tmp_path: Path, overrides: dict[str, Any]) -> None:
    hf = build_hf("marian", **overrides)
    zoo = load_zoo(save(hf, tmp_path))
    assert isinstance(zoo, models.Seq2SeqTransformer)
    assert zoo.config.positional == "sinusoidal_concat" and zoo.config.output_bias
    assert_close_on(*seq2seq_logits(hf, zoo))


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": False, "scale_embedding": True, "activation_function": "gelu_new"}],
    ids=["default", "untied-scaled"],
)
def test_bart_logits_match_transformers(tmp_path: Path, overrides: dict[str, Any]) -> None:
    hf = build_hf("bart", **overrides)
    zoo = load_zoo(save(hf, tmp_path))
    assert isinstance(zoo, models.Seq2SeqTransformer)
    assert zoo.config.embedding_norm and zoo.config.output_bias and zoo.config.max_len == 32
    assert_close_on(*seq2seq_logits(hf, zoo))


# ---------------------------------------------------------------------------------------------- greedy generation
def stop_token(first: Tensor, start: int) -> int:
    """An EOS id that makes the rows of a greedy run stop at different steps: the first token (in row-major
    order) that some rows generate and others do not. ``first`` is the run without it, generated from ``start``."""
    rows = [set(row) for row in first[:, start:].tolist()]
    for token in first[:, start:].flatten().tolist():
        if not all(token in row for row in rows):
            return token
    raise AssertionError(f"the greedy outputs {first.tolist()} offer no token that stops only some rows")


def assert_rows_stop_at_different_steps(output: Tensor, start: int, eos: int) -> None:
    stopped = (output[:, start:] == eos).any(dim=1)
    assert stopped.any() and not stopped.all()


def test_gpt2_greedy_generation_matches_transformers(tmp_path: Path) -> None:
    hf = build_hf("gpt2")
    zoo = load_zoo(save(hf, tmp_path))
    ids, mask = inputs(6, pad=0)
    ids[1, :2], mask[1, :2] = 0, False  # decoder-only generation pads on the left
    settings = dict(attention_mask=mask.long(), max_new_tokens=10, do_sample=False, num_beams=1, pad_token_id=0)
    eos = stop_token(hf.generate(ids, **settings), ids.shape[1])
    expected = hf.generate(ids, **settings, eos_token_id=eos)
    actual = zoo.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(actual, expected)
    assert_rows_stop_at_different_steps(expected, ids.shape[1], eos)


@pytest.mark.parametrize("model_type", ["marian", "bart"])
def test_seq2seq_greedy_generation_matches_transformers(tmp_path: Path, model_type: str) -> None:
    hf = build_hf(model_type)
    hf.generation_config.forced_eos_token_id = None  # the zoo does not force a final EOS
    zoo = load_zoo(save(hf, tmp_path))
    src, mask = inputs(7, pad=2, batch=4)
    settings = dict(attention_mask=mask.long(), max_new_tokens=10, do_sample=False, num_beams=1)
    eos = stop_token(hf.generate(src, **settings), 1)
    expected = hf.generate(src, **settings, eos_token_id=eos)
    actual = zoo.generate(src, src_mask=mask, max_new_tokens=10, num_beams=1, eos_token_id=eos)
    assert torch.equal(actual, expected)
    assert_rows_stop_at_different_steps(expected, 1, eos)


# ---------------------------------------------------------------------------------------------- base-model checkpoints
def test_bert_model_checkpoint_loads_encoder_and_leaves_head_missing(tmp_path: Path) -> None:
    hf = build_hf("bert", model_class="BertModel")
    config, state_dict = read_checkpoint(save(hf, tmp_path))
    with pytest.warns(UserWarning, match="pooler"):
        converted = from_transformers(config, state_dict)
    assert converted.allow_missing == {
        "mlm_head.dense.weight", "mlm_head.dense.bias", "mlm_head.norm.weight", "mlm_head.norm.bias",
        "mlm_head.decoder.bias",
    }
    assert converted.allow_missing.isdisjoint(converted.state_dict)
    zoo = instantiate(converted)
    ids, mask = inputs()
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask.long()).last_hidden_state
        actual = zoo(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    assert_close_on(mask, expected, actual)


def test_gpt2_model_checkpoint_without_prefix_loads_completely(tmp_path: Path) -> None:
    hf = build_hf("gpt2", model_class="GPT2Model")
    converted = from_transformers(*read_checkpoint(save(hf, tmp_path)))
    assert converted.allow_missing == frozenset()  # the tied head is the token embedding
    zoo = instantiate(converted)
    ids, mask = inputs()
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask.long()).last_hidden_state
        actual = zoo(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    assert_close_on(mask, expected, actual)


@pytest.mark.parametrize("model_type, model_class", [("bart", "BartModel"), ("marian", "MarianModel")])
def test_seq2seq_base_checkpoint_gets_zero_logits_bias(tmp_path: Path, model_type: str, model_class: str) -> None:
    converted = from_transformers(*read_checkpoint(save(build_hf(model_type, model_class=model_class), tmp_path)))
    assert converted.allow_missing == frozenset()
    assert torch.equal(converted.state_dict["lm_head.bias"], torch.zeros(VOCAB))


def test_untied_base_checkpoint_allows_the_missing_head(tmp_path: Path) -> None:
    hf = build_hf("gpt2", model_class="GPT2Model", tie_word_embeddings=False)
    converted = from_transformers(*read_checkpoint(save(hf, tmp_path)))
    assert converted.allow_missing == {"lm_head.weight"}
    assert "lm_head.weight" not in converted.state_dict


# ---------------------------------------------------------------------------------------------- the loader
def test_bert_model_checkpoint_through_the_loader_warns_about_the_head(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hf = build_hf("bert", model_class="BertModel")
    with pytest.warns(UserWarning, match="pooler"), caplog.at_level("WARNING"):
        zoo = load_zoo(save(hf, tmp_path))
    assert "mlm_head" in caplog.text and "initialisation" in caplog.text
    ids, mask = inputs()
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask.long()).last_hidden_state
        actual = zoo(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    assert_close_on(mask, expected, actual)


def test_pytorch_bin_checkpoint_loads_through_weights_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers 5 writes safetensors only; older versions wrote the whole state dict (the tied lm_head
    # copy included) with torch.save, as here.
    hf = build_hf("gpt2")
    save(hf, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    calls: list[dict[str, Any]] = []
    real_load = torch.load

    def recording_load(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    zoo = load_zoo(tmp_path)
    assert calls and all(c.get("weights_only") is True for c in calls)
    ids, mask = inputs()
    with torch.no_grad():
        assert_close_on(mask, hf(ids, attention_mask=mask.long()).logits, zoo(ids, attention_mask=mask).logits)


def test_tokenizer_json_loads_with_the_model(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models

    tokenizer = Tokenizer(tokenizer_models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    save(build_hf("marian"), tmp_path)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    zoo = load_zoo(tmp_path)
    assert zoo.tokenizer is not None and zoo.tokenizer.token_to_id("world") == 2


def test_bert_mask_token_comes_from_the_checkpoints_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models

    vocab = {"[PAD]": 0, "[UNK]": 1, "hello": 2, "[MASK]": 7}
    tokenizer = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["[PAD]", "[UNK]", "[MASK]"])
    save(build_hf("bert"), tmp_path)
    assert load_zoo(tmp_path).config.mask_token_id is None  # BERT's config.json does not store it
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert load_zoo(tmp_path).config.mask_token_id == 7


def test_class_from_pretrained_checks_the_converted_architecture(tmp_path: Path) -> None:
    save(build_hf("gpt2"), tmp_path)
    assert isinstance(models.DecoderLM.from_pretrained(tmp_path), models.DecoderLM)
    with pytest.raises(ValueError, match="converts to DecoderLM, not EncoderLM"):
        models.EncoderLM.from_pretrained(tmp_path)


def test_loader_reports_unsupported_features(tmp_path: Path) -> None:
    save(build_hf("gpt2", scale_attn_by_inverse_layer_idx=True), tmp_path)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=True"):
        load_zoo(tmp_path)


# ---------------------------------------------------------------------------------------------- state-dict variants
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], dict[str, Tensor]]]:
    """One saved default checkpoint per family: ``model_type -> (config dict, state dict)``."""
    out = {}
    for model_type in FAMILIES:
        path = tmp_path_factory.mktemp(model_type)
        out[model_type] = read_checkpoint(save(build_hf(model_type), path))
    return out


def test_old_bert_gamma_beta_names_load(checkpoints: dict) -> None:
    config, state_dict = checkpoints["bert"]
    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
           for k, v in state_dict.items()}
    assert old.keys() != state_dict.keys()
    new, renamed = from_transformers(config, state_dict), from_transformers(config, old)
    assert new.state_dict.keys() == renamed.state_dict.keys()
    assert all(torch.equal(new.state_dict[k], renamed.state_dict[k]) for k in new.state_dict)


def test_stale_buffers_and_tied_copies_are_ignored(checkpoints: dict) -> None:
    config, state_dict = checkpoints["gpt2"]
    extra = dict(state_dict)
    extra["transformer.h.0.attn.bias"] = torch.ones(1, 1, 32, 32).tril()  # the causal mask older versions saved
    extra["lm_head.weight"] = state_dict["transformer.wte.weight"].clone()
    converted = from_transformers(config, extra)
    assert converted.state_dict["lm_head.weight"] is converted.state_dict["embed_tokens.weight"]


def test_marian_stored_position_tables_are_checked(checkpoints: dict) -> None:
    config, state_dict = checkpoints["marian"]
    table = transformers.MarianMTModel(transformers.MarianConfig(**MARIAN)).model.encoder.embed_positions.weight
    with_table = {**state_dict, "model.encoder.embed_positions.weight": table.detach().clone()}
    from_transformers(config, with_table)  # the sinusoids transformers computes are accepted
    with_table["model.encoder.embed_positions.weight"] = table.detach() + 0.01
    with pytest.raises(ValueError, match="embed_positions.*sinusoids"):
        from_transformers(config, with_table)


def test_missing_tensor_is_named(checkpoints: dict) -> None:
    config, state_dict = checkpoints["bart"]
    partial = {k: v for k, v in state_dict.items() if k != "model.decoder.layers.1.fc2.weight"}
    with pytest.raises(ValueError, match=r"lacks the tensor 'decoder\.layers\.1\.fc2\.weight'"):
        from_transformers(config, partial)


def test_unplaceable_tensor_is_named(checkpoints: dict) -> None:
    config, state_dict = checkpoints["bert"]
    with pytest.raises(ValueError, match="no place for: 'classifier.weight'"):
        from_transformers(config, {**state_dict, "classifier.weight": torch.zeros(2, 32)})


def test_config_that_disagrees_with_the_weights_is_reported(checkpoints: dict) -> None:
    config, state_dict = checkpoints["gpt2"]
    with pytest.raises(ValueError, match=r"up_proj\.weight.*shape \(128, 32\).*\(64, 32\)"):
        from_transformers({**config, "n_inner": 64}, state_dict)


def test_bad_arguments_are_rejected(checkpoints: dict) -> None:
    config, state_dict = checkpoints["gpt2"]
    with pytest.raises(ValueError, match="model_type"):
        from_transformers({k: v for k, v in config.items() if k != "model_type"}, state_dict)
    with pytest.raises(ValueError, match="model_type"):
        from_transformers([("model_type", "gpt2")], state_dict)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mapping"):
        from_transformers(config, list(state_dict.items()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="str keys to tensors"):
        from_transformers(config, {**state_dict, "transformer.wte.weight": [1.0]})


def test_unknown_model_type_lists_the_supported_ones(checkpoints: dict) -> None:
    config, state_dict = checkpoints["gpt2"]
    with pytest.raises(ValueError, match=r"'falcon'.*\['bart', 'bert', .*'gpt2', .*'llama', 'marian'"):
        from_transformers({**config, "model_type": "falcon"}, state_dict)


def test_generic_field_names_are_read_like_transformers(checkpoints: dict) -> None:
    config, state_dict = checkpoints["gpt2"]
    generic = {k: v for k, v in config.items() if k not in ("n_embd", "n_layer", "n_head", "n_positions")}
    generic.update(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32)
    assert from_transformers(generic, state_dict).config == from_transformers(config, state_dict).config


# ---------------------------------------------------------------------------------------------- unsupported features
UNSUPPORTED = [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights=False"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention=True"),
    ("gpt2", {"activation_function": "quick_gelu"}, "activation_function='quick_gelu'"),
    ("gpt2", {"eos_token_id": [2, 3]}, r"eos_token_id=\[2, 3\]"),
    ("bert", {"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
    ("bert", {"is_decoder": True}, "is_decoder=True"),
    ("bert", {"hidden_act": "relu"}, "hidden_act='relu'.*MLM head"),
    ("marian", {"decoder_vocab_size": VOCAB + 1}, "decoder_vocab_size"),
    ("marian", {"decoder_attention_heads": 2}, "decoder_attention_heads=2"),
    ("marian", {"decoder_ffn_dim": 64}, "decoder_ffn_dim=64"),
    ("marian", {"normalize_before": True}, "normalize_before=True"),
    ("marian", {"is_encoder_decoder": False}, "is_encoder_decoder=False"),
    ("bart", {"normalize_before": True}, "normalize_before=True"),
    ("bart", {"add_final_layer_norm": True}, "add_final_layer_norm=True"),
    ("bart", {"normalize_embedding": False}, "normalize_embedding=False"),
    ("bart", {"activation_function": "tanh"}, "activation_function='tanh'"),
]


@pytest.mark.parametrize("model_type, overrides, match", UNSUPPORTED, ids=[f"{t}-{m}" for t, _, m in UNSUPPORTED])
def test_unsupported_features_raise(checkpoints: dict, model_type: str, overrides: dict[str, Any], match: str) -> None:
    config, state_dict = checkpoints[model_type]
    with pytest.raises(ValueError, match=match):
        from_transformers({**config, **overrides}, state_dict)


def test_training_only_differences_warn(checkpoints: dict) -> None:
    config, state_dict = checkpoints["bart"]
    with pytest.warns(UserWarning, match="activation_dropout=0.2.*training only"):
        from_transformers({**config, "activation_dropout": 0.2}, state_dict)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_transformers(config, state_dict)  # the defaults warn about nothing


# ---------------------------------------------------------------------------------------------- registry
def test_registry_holds_the_four_families_and_rejects_duplicates() -> None:
    assert {"gpt2", "bert", "marian", "bart"} <= set(supported_model_types())
    with pytest.raises(ValueError, match="already registered"):
        register_converter("gpt2")(lambda hf_config, state_dict: None)


# ---------------------------------------------------------------------------------------------- export
def perturbed(model: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


SMALL = dict(vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=48, max_len=32, bos_token_id=0, eos_token_id=2)
EXPORTABLE = [
    ("gpt2", "GPT2LMHeadModel", lambda: models.DecoderLM(models.DecoderLMConfig(**SMALL))),
    ("gpt2", "GPT2LMHeadModel",
     lambda: models.DecoderLM(models.DecoderLMConfig(**SMALL, ffn="relu", tie_embeddings=False, norm_eps=1e-6))),
    ("bert", "BertForMaskedLM", lambda: models.EncoderLM(models.EncoderLMConfig(**SMALL, mask_token_id=4))),
    ("bert", "BertForMaskedLM",
     lambda: models.EncoderLM(models.EncoderLMConfig(**SMALL, tie_embeddings=False, type_vocab_size=0))),
] + [
    (family, hf_class, lambda positional=positional, share=share, tie=tie: models.Seq2SeqTransformer(
        models.Seq2SeqConfig(**SMALL, positional=positional, embedding_norm=positional == "learned", output_bias=True,
                             share_embeddings=share, tie_embeddings=tie, ffn="silu", decoder_start_token_id=1)))
    for family, hf_class, positional in (("marian", "MarianMTModel", "sinusoidal_concat"),
                                         ("bart", "BartForConditionalGeneration", "learned"))
    for share, tie in ((True, True), (False, True), (True, False), (False, False))
]


@pytest.mark.parametrize("model_type, hf_class, make", EXPORTABLE,
                         ids=[f"{t}-{i}" for i, (t, _, _) in enumerate(EXPORTABLE)])
def test_export_loads_in_transformers_and_converts_back(tmp_path: Path, model_type: str, hf_class: str, make) -> None:
    zoo = perturbed(make())
    save_transformers(zoo, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == model_type
    hf, info = getattr(transformers, hf_class).from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    hf.eval()
    ids, mask = inputs()
    with torch.no_grad():
        if isinstance(zoo, models.Seq2SeqTransformer):
            tgt, tgt_mask = ids[:, :5], mask[:, :5]
            expected = hf(input_ids=ids, attention_mask=mask.long(), decoder_input_ids=tgt,
                          decoder_attention_mask=tgt_mask.long()).logits
            actual, mask = zoo(ids, tgt, src_mask=mask, tgt_mask=tgt_mask).logits, tgt_mask
        else:
            expected, actual = hf(ids, attention_mask=mask.long()).logits, zoo(ids, attention_mask=mask).logits
    assert_close_on(mask, expected, actual)

    # Converting the export back gives the same weights and config, up to what the export had to spell out:
    # an all-zero segment table for a model without one, and separate matrices for partly tied embeddings.
    back = from_transformers(*to_transformers(zoo))
    assert back.architecture is type(zoo)
    original = zoo.state_dict()
    added = set(back.state_dict) - set(original)
    assert added <= {"token_type_embed.weight"} and all(not back.state_dict[k].any() for k in added)
    assert all(torch.equal(back.state_dict[k], original[k]) for k in original)
    changes: dict[str, Any] = {}
    if isinstance(zoo, models.EncoderLM) and zoo.config.type_vocab_size == 0:
        changes["type_vocab_size"] = 1
    if isinstance(zoo, models.Seq2SeqTransformer) and not (zoo.config.share_embeddings and zoo.config.tie_embeddings):
        changes.update(share_embeddings=False, tie_embeddings=False)
    assert back.config == zoo.config.replace(**changes)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: models.DecoderLM(models.DecoderLMConfig(**SMALL, positional="rotary", norm="rmsnorm")),
         "gpt2: positional='rotary'"),
        (lambda: models.DecoderLM(models.DecoderLMConfig(**SMALL, n_kv_heads=2)), "gpt2: n_kv_heads=2"),
        (lambda: models.EncoderLM(models.EncoderLMConfig(**SMALL, ffn="relu", pad_token_id=None)), "bert: ffn='relu'"),
        (lambda: models.Seq2SeqTransformer(models.Seq2SeqConfig(**SMALL, sublayer="pre_norm")),
         "bart: positional='sinusoidal'.*marian: positional='sinusoidal'"),
        (lambda: models.Seq2SeqTransformer(models.Seq2SeqConfig(**SMALL, positional="learned", norm="rmsnorm",
                                                                embedding_norm=True)), "bart: norm='rmsnorm'"),
    ],
    ids=["rotary", "gqa", "bert-relu", "paper-seq2seq", "rmsnorm"],
)
def test_export_of_unrepresentable_models_raises(tmp_path: Path, make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        save_transformers(make(), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_export_to_a_named_family(tmp_path: Path) -> None:
    zoo = models.DecoderLM(models.DecoderLMConfig(**SMALL))
    assert to_transformers(zoo, "gpt2")[0]["model_type"] == "gpt2"
    with pytest.raises(ValueError, match="as 'bert': DecoderLM is not an EncoderLM"):
        to_transformers(zoo, "bert")
    with pytest.raises(ValueError, match="unknown hf_exporter 'falcon'"):
        to_transformers(zoo, "falcon")

