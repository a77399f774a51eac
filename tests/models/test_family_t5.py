"""T5 1.0 and T5 1.1 / Flan-T5 checkpoints against ``transformers``' ``T5ForConditionalGeneration``: teacher-forced
logits, greedy and beam-search generation, export, and refusals.

Beam search: the zoo's and ``transformers``' algorithms keep the same live beams (the best ``num_beams`` of the
``2 · num_beams`` best extensions that do not end), so without an end token they find the same hypotheses. With
one they differ legitimately: ``transformers`` keeps an ended extension only if it ranks among the best
``num_beams``, the zoo keeps every ended one of the ``2 · num_beams`` (as tensor2tensor), and each stops by its own
rule. The zoo's finished set then contains ``transformers``' up to its stopping point, after which no live beam
can improve on it, so with ``length_penalty=0`` the zoo's result is never less probable: that is what is tested.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import models
from models import Seq2SeqTransformer
from models.convert import from_transformers, save_transformers, to_transformers
from tests.models.family_harness import assert_logits_close, build_hf, right_padded

VOCAB = 251  # odd, prime
# Non-default sizes: n_heads * d_kv = 60 != d_model, more encoder than decoder layers (transformers 5.23's generate
# sizes its cache by the encoder's count and fails with more decoder layers), few buckets and a short
# max_distance so that the sequences below reach the logarithmic buckets and the last one.
BASE = dict(vocab_size=VOCAB, d_model=40, d_kv=12, d_ff=56, num_layers=3, num_decoder_layers=2, num_heads=5,
            relative_attention_num_buckets=12, relative_attention_max_distance=20, layer_norm_epsilon=1e-5,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
CONFIGS = {
    "t5-1.0": dict(feed_forward_proj="relu"),  # tied head, decoder output scaled by d_model^-0.5
    "t5-1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),  # untied lm_head below
}
SRC_LEN, TGT_LEN = 30, 26


def t5_pair(name: str, tmp_path: Path, scale: float = 0.1) -> tuple[nn.Module, Seq2SeqTransformer]:
    """A random ``T5ForConditionalGeneration`` (weights perturbed by ``scale``: larger gives flatter next-token
    distributions, on which beams part from greedy decoding) and the zoo model loaded from its saved folder."""
    hf = build_hf("T5Config", "T5ForConditionalGeneration", scale=scale, **BASE, **CONFIGS[name])
    if name == "t5-1.1":
        # transformers 5 builds T5 with the head tied; T5 1.1 / Flan checkpoints store their own lm_head.
        gen = torch.Generator().manual_seed(7)
        noise = torch.randn(VOCAB, BASE["d_model"], generator=gen) * scale
        hf.lm_head.weight = nn.Parameter(hf.shared.weight.detach() + noise)
    hf.save_pretrained(tmp_path / "hf")
    zoo = models.from_pretrained(tmp_path / "hf").eval()
    assert isinstance(zoo, Seq2SeqTransformer)
    return hf, zoo


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, nn.Module, Any]:
    hf, zoo = t5_pair(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, hf, zoo


def batch(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A right-padded source batch and a right-padded decoder batch (row 1 padded in both)."""
    src, src_mask = right_padded(VOCAB, SRC_LEN, seed=seed, pad=7)
    tgt, tgt_mask = right_padded(VOCAB, TGT_LEN, seed=seed + 1, pad=5)
    tgt[:, 0] = 0  # the decoder start token
    return src, src_mask, tgt, tgt_mask


def test_converted_config(pair: tuple[str, nn.Module, Any]) -> None:
    name, hf, zoo = pair
    c = zoo.config
    assert (c.positional, c.norm, c.sublayer, c.bias, c.d_head, c.n_decoder_layers) == (
        "t5_relative", "rmsnorm", "pre_norm", False, 12, 2)
    assert c.block_options("attention") == {"scale": 1.0}
    assert c.block_options("positional") == {"num_buckets": 12, "max_distance": 20}
    if name == "t5-1.0":
        assert (c.ffn, c.tie_embeddings, c.output_scale) == ("relu", True, 40**-0.5)
    else:
        assert (c.ffn, c.tie_embeddings, c.output_scale) == ("geglu_tanh", False, 1.0)
        assert torch.equal(zoo.encoder_layers[0].ffn.gate_proj.weight,
                           hf.encoder.block[0].layer[1].DenseReluDense.wi_0.weight)
    assert c.decoder_start_token_id == 0 and c.bos_token_id is None


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@torch.no_grad()
def test_teacher_forced_logits(pair: tuple[str, nn.Module, Any], backend: str) -> None:
    _, hf, zoo = pair
    src, src_mask, tgt, tgt_mask = batch()
    zoo.set_attention_backend(backend)
    try:
        expected = hf(input_ids=src, decoder_input_ids=tgt).logits
        assert_logits_close(expected, zoo(src, tgt).logits)
        # Padded source (positions 0..L-1 in transformers; the pad keys are masked) and padded target.
        expected = hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt,
                      decoder_attention_mask=tgt_mask).logits
        actual = zoo(src, tgt, src_mask=src_mask.bool(), tgt_mask=tgt_mask.bool()).logits
        assert_logits_close(expected, actual, tgt_mask)
    finally:
        zoo.set_attention_backend("sdpa")


@torch.no_grad()
def test_greedy_generation_matches_transformers(pair: tuple[str, nn.Module, Any]) -> None:
    _, hf, zoo = pair
    src, src_mask = right_padded(VOCAB, 11, seed=3, pad=4)
    expected = hf.generate(input_ids=src, attention_mask=src_mask, num_beams=1, do_sample=False, max_new_tokens=20,
                           min_new_tokens=20)
    actual = zoo.generate(src, src_mask.bool(), max_new_tokens=20, num_beams=1, eos_token_id=None)
    assert actual.shape == (2, 21)
    assert torch.equal(actual, expected), (actual, expected)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("num_beams", [2, 4])
@torch.no_grad()
def test_beam_search_without_eos_matches_transformers(name: str, num_beams: int, tmp_path: Path) -> None:
    hf, zoo = t5_pair(name, tmp_path, scale=0.3)
    src, src_mask = right_padded(VOCAB, 11, seed=4, pad=4)
    expected = hf.generate(input_ids=src, attention_mask=src_mask, num_beams=num_beams, do_sample=False,
                           max_new_tokens=10, min_new_tokens=10, length_penalty=0.0, early_stopping=False)
    actual = zoo.generate(src, src_mask.bool(), max_new_tokens=10, num_beams=num_beams, length_penalty=0.0,
                          eos_token_id=None)
    assert torch.equal(actual, expected), (actual, expected)
    greedy = zoo.generate(src, src_mask.bool(), max_new_tokens=10, num_beams=1, eos_token_id=None)
    assert not torch.equal(actual, greedy)  # the beams do search


def sequence_log_prob(hf: nn.Module, src: Tensor, src_mask: Tensor, seq: Tensor, eos: int) -> Tensor:
    """log P(seq | src) under ``transformers``' model, up to and including the first ``eos`` (seq starts with the
    decoder start token)."""
    tokens = seq[1:]
    end = int((tokens == eos).nonzero()[0]) + 1 if bool((tokens == eos).any()) else len(tokens)
    logits = hf(input_ids=src[None], attention_mask=src_mask[None], decoder_input_ids=seq[None, :end]).logits[0]
    return torch.log_softmax(logits, -1).gather(1, tokens[:end, None]).sum()


@pytest.mark.parametrize("num_beams", [2, 4])
@torch.no_grad()
def test_beam_search_with_eos_is_never_less_probable(tmp_path: Path, num_beams: int) -> None:
    """See the module docstring: with an end token the zoo's finished set contains transformers', so its best
    hypothesis scores at least as high (length_penalty=0: the score is log P)."""
    hf, zoo = t5_pair("t5-1.1", tmp_path, scale=0.3)
    src, src_mask = right_padded(VOCAB, 9, seed=5, pad=3)
    top_tokens = hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=torch.zeros(2, 1, dtype=torch.long))
    strictly_better = agree = 0
    # End tokens that compete early: the likeliest first tokens of each source.
    for eos in top_tokens.logits[:, 0].topk(6, dim=-1).indices.flatten().unique().tolist():
        expected = hf.generate(input_ids=src, attention_mask=src_mask, num_beams=num_beams, do_sample=False,
                               max_new_tokens=8, length_penalty=0.0, early_stopping=False, eos_token_id=eos,
                               pad_token_id=0)
        actual, scores = zoo.generate(src, src_mask.bool(), max_new_tokens=8, num_beams=num_beams,
                                      length_penalty=0.0, eos_token_id=eos, pad_token_id=0, return_scores=True)
        for row in range(2):
            ours = sequence_log_prob(hf, src[row], src_mask[row], actual[row], eos)
            theirs = sequence_log_prob(hf, src[row], src_mask[row], expected[row], eos)
            torch.testing.assert_close(scores[row], ours, atol=1e-4, rtol=0)  # the zoo's score is log P
            assert ours >= theirs - 1e-4, (eos, row, actual[row], expected[row])
            strictly_better += bool(ours > theirs + 1e-4)
            agree += bool(abs(ours - theirs) <= 1e-4)
    assert agree > 0 and strictly_better > 0  # both situations occur in this sample


@torch.no_grad()
def test_export_loads_in_transformers_with_the_same_logits(pair: tuple[str, nn.Module, Any], tmp_path: Path) -> None:
    name, hf, zoo = pair
    src, src_mask, tgt, _ = batch(seed=9)
    expected = hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits
    folder = save_transformers(zoo, tmp_path / "exported")
    reloaded = type(hf).from_pretrained(folder).float().eval()
    assert reloaded.config.scale_decoder_outputs is (name == "t5-1.0")
    assert (reloaded.lm_head.weight is reloaded.shared.weight) is (name == "t5-1.0")
    assert_logits_close(expected, reloaded(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits)


@torch.no_grad()
def test_tied_head_without_scaling_round_trips(tmp_path: Path) -> None:
    """transformers 5 ties a T5 1.1 head whose checkpoint stores none (or an equal one): no scaling, tied."""
    hf = build_hf("T5Config", "T5ForConditionalGeneration", **BASE, feed_forward_proj="gated-gelu",
                  tie_word_embeddings=False)
    assert hf.lm_head.weight is hf.shared.weight
    hf.save_pretrained(tmp_path / "hf")
    zoo = models.from_pretrained(tmp_path / "hf").eval()
    assert zoo.config.tie_embeddings and zoo.config.output_scale == 1.0
    src, src_mask, tgt, _ = batch(seed=2)
    expected = hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits
    assert_logits_close(expected, zoo(src, tgt, src_mask=src_mask.bool()).logits)
    reloaded = type(hf).from_pretrained(save_transformers(zoo, tmp_path / "exported")).eval()
    assert_logits_close(expected, reloaded(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits)


def hf_checkpoint(**overrides: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    hf = build_hf("T5Config", "T5ForConditionalGeneration", **BASE, feed_forward_proj="relu")
    return {**hf.config.to_dict(), **overrides}, dict(hf.state_dict())


@pytest.mark.parametrize("key,value", [
    ("feed_forward_proj", "gated-relu"), ("feed_forward_proj", "gelu_accurate"), ("is_encoder_decoder", False),
])
def test_unsupported_config_values_are_refused_by_name(key: str, value: Any) -> None:
    config, state = hf_checkpoint(**{key: value})
    with pytest.raises(ValueError, match=f"{key}={value!r}"):
        from_transformers(config, state)


def test_other_checkpoint_problems_are_refused_by_name() -> None:
    config, state = hf_checkpoint()
    state["encoder.embed_tokens.weight"] = state["shared.weight"] + 1.0
    with pytest.raises(ValueError, match="encoder.embed_tokens.weight differs"):
        from_transformers(config, state)
    config, state = hf_checkpoint()
    state["encoder.block.0.layer.0.SelfAttention.q.bias"] = torch.zeros(60)
    with pytest.raises(ValueError, match="q.bias"):
        from_transformers(config, state)
    config, state = hf_checkpoint()
    del state["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    with pytest.raises(ValueError, match="decoder.block.0.layer.0.SelfAttention.relative_attention_bias"):
        from_transformers(config, state)


def test_old_config_json_defaults_and_stale_tensors() -> None:
    """Flan-T5's config.json as the Hub has it (tie_word_embeddings false, no scale_decoder_outputs), one without
    decoder_start_token_id (the pad id then), and the unused cross-attention table old versions saved."""
    config, state = hf_checkpoint()
    config = {k: v for k, v in config.items() if k not in ("scale_decoder_outputs", "decoder_start_token_id")}
    config.update(tie_word_embeddings=False, pad_token_id=5)
    state["lm_head.weight"] = state["shared.weight"] * 2.0
    state["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = torch.zeros(12, 5)
    c = from_transformers(config, state).config
    assert (c.tie_embeddings, c.output_scale, c.decoder_start_token_id, c.pad_token_id) == (False, 1.0, 5, 5)


@torch.no_grad()
def test_left_padded_source_gives_the_same_logits(pair: tuple[str, nn.Module, Any]) -> None:
    """Relative positions depend on distances only, so the zoo's real-token positions match transformers'."""
    _, hf, zoo = pair
    src, src_mask, tgt, _ = batch(seed=11)
    src_mask = src_mask.flip(1)
    expected = hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits
    assert_logits_close(expected, zoo(src, tgt, src_mask=src_mask.bool()).logits)


def test_gated_silu_maps_to_swiglu() -> None:
    config, state = hf_checkpoint()
    state = {k.replace("DenseReluDense.wi.", "DenseReluDense.wi_0."): v for k, v in state.items()}
    state.update({k.replace("wi_0", "wi_1"): v.flip(0) for k, v in state.items() if "wi_0" in k})
    converted = from_transformers({**config, "feed_forward_proj": "gated-silu"}, state)
    assert converted.config.ffn == "swiglu"
    assert to_transformers(Seq2SeqTransformer(converted.config), "t5")[0]["feed_forward_proj"] == "gated-silu"


def test_export_refuses_what_t5_cannot_represent() -> None:
    with pytest.raises(ValueError, match="positional"):
        to_transformers(Seq2SeqTransformer.from_preset("tiny"), "t5")  # the paper's model
    with pytest.raises(ValueError, match="attention options"):
        to_transformers(Seq2SeqTransformer.from_preset("t5-tiny", options={}), "t5")  # scaled scores
    with pytest.raises(ValueError, match="untied head"):
        to_transformers(Seq2SeqTransformer.from_preset("t5-tiny", tie_embeddings=False), "t5")
    with pytest.raises(ValueError, match="n_kv_heads"):
        to_transformers(Seq2SeqTransformer.from_preset("t5-tiny", n_kv_heads=2), "t5")


@torch.no_grad()
def test_tiny_preset_round_trips_through_transformers_format() -> None:
    torch.manual_seed(0)
    model = Seq2SeqTransformer.from_preset("t5-tiny", vocab_size=97).eval()
    config, state = to_transformers(model, "t5")
    back = from_transformers(config, state)
    assert back.config == model.config
    reloaded = Seq2SeqTransformer(back.config).eval()
    reloaded.load_state_dict(back.state_dict)
    src, tgt = torch.randint(0, 97, (2, 13)), torch.randint(0, 97, (2, 7))
    torch.testing.assert_close(reloaded(src, tgt).logits, model(src, tgt).logits, atol=0, rtol=0)


def test_flan_t5_small_preset_is_the_published_shape() -> None:
    """The fields of google/flan-t5-small's config.json that fix the model."""
    published = {
        "d_ff": 1024, "d_kv": 64, "d_model": 512, "decoder_start_token_id": 0, "dropout_rate": 0.1,
        "eos_token_id": 1, "feed_forward_proj": "gated-gelu", "layer_norm_epsilon": 1e-06, "n_positions": 512,
        "num_decoder_layers": 8, "num_heads": 6, "num_layers": 8, "pad_token_id": 0,
        "relative_attention_max_distance": 128, "relative_attention_num_buckets": 32, "tie_word_embeddings": False,
        "vocab_size": 32128,
    }
    with torch.device("meta"):  # the real size, without allocating it
        model = Seq2SeqTransformer.from_preset("flan-t5-small")
    config, _ = to_transformers(model, "t5")
    assert {k: config[k] for k in published} == published
