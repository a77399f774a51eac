"""Properties of the three model families, over configs drawn from the registries."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import blocks
from models import (
    DecoderLM,
    DecoderLMConfig,
    EncoderLM,
    EncoderLMConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
)

VOCAB = 50
BACKENDS = blocks.names("attention_backend")
POSITIONALS = blocks.names("positional")


@st.composite
def shared_fields(draw, backend=None, positional=None):
    """Common config fields of a tiny model, every block name drawn from its registry."""
    n_heads = draw(st.sampled_from([1, 2, 4]))
    n_kv_heads = draw(st.sampled_from([h for h in (1, 2, 4) if n_heads % h == 0]))
    d_head = draw(st.sampled_from([4, 8]))
    return dict(
        vocab_size=VOCAB,
        d_model=16,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_head=d_head,
        d_ff=32,
        dropout=0.0,
        max_len=64,
        positional=positional or draw(st.sampled_from(POSITIONALS)),
        ffn=draw(st.sampled_from(blocks.names("ffn"))),
        norm=draw(st.sampled_from(blocks.names("norm"))),
        sublayer=draw(st.sampled_from(blocks.names("sublayer"))),
        attention_backend=backend or draw(st.sampled_from(BACKENDS)),
        bias=draw(st.booleans()),
    )


@st.composite
def decoder_configs(draw, **kw):
    return DecoderLMConfig(**draw(shared_fields(**kw)), n_layers=draw(st.integers(1, 2)))


@st.composite
def encoder_configs(draw, **kw):
    return EncoderLMConfig(**draw(shared_fields(**kw)), n_layers=draw(st.integers(1, 2)))


@st.composite
def seq2seq_configs(draw, **kw):
    return Seq2SeqConfig(
        **draw(shared_fields(**kw)),
        n_encoder_layers=draw(st.integers(1, 2)),
        n_decoder_layers=draw(st.integers(1, 2)),
        share_embeddings=draw(st.booleans()),
    )


def ids(b: int, length: int, low: int = 5) -> torch.Tensor:
    return torch.randint(low, VOCAB, (b, length))


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)


# ---------------------------------------------------------------------------------------- causality
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=8)
@given(config=decoder_configs(), t=st.integers(0, 8), seed=st.integers(0, 2**16))
def test_decoder_lm_is_causal(backend, config, t, seed):
    torch.manual_seed(seed)
    model = DecoderLM(config.replace(attention_backend=backend)).eval()
    x = ids(2, 10)
    y = x.clone()
    y[:, t + 1:] = ids(2, 10 - t - 1) if t < 9 else y[:, t + 1:]
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    close(a[:, : t + 1], b[:, : t + 1])


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=6)
@given(config=seq2seq_configs(), t=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_seq2seq_decoder_is_causal(backend, config, t, seed):
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(config.replace(attention_backend=backend)).eval()
    src, tgt = ids(2, 9), ids(2, 8)
    changed = tgt.clone()
    changed[:, t + 1:] = ids(2, 8 - t - 1)
    with torch.no_grad():
        a, b = model(src, tgt).logits, model(src, changed).logits
    close(a[:, : t + 1], b[:, : t + 1])


def test_causality_test_would_catch_a_leak():
    """The causality property is sensitive: an encoder layer stack (bidirectional) does leak."""
    model = EncoderLM(EncoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, dropout=0.0)).eval()
    x = ids(1, 6)
    y = x.clone()
    y[:, -1] = (x[:, -1] + 1) % VOCAB
    with torch.no_grad():
        assert not torch.allclose(model(x).logits[:, 0], model(y).logits[:, 0])


# ---------------------------------------------------------------------------------------- equivariance
@settings(max_examples=10)
@given(config=encoder_configs(positional="none"), seed=st.integers(0, 2**16))
def test_encoder_lm_without_positions_is_permutation_equivariant(config, seed):
    torch.manual_seed(seed)
    model = EncoderLM(config).eval()
    x = ids(2, 7)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    perm = torch.randperm(7)
    with torch.no_grad():
        out = model(x, attention_mask=mask).logits
        permuted = model(x[:, perm], attention_mask=mask[:, perm]).logits
    close(out[:, perm], permuted)


@settings(max_examples=6)
@given(config=encoder_configs(positional="learned"), seed=st.integers(0, 2**16))
def test_encoder_lm_with_positions_is_not_permutation_equivariant(config, seed):
    torch.manual_seed(seed)
    model = EncoderLM(config).eval()
    x = torch.arange(5, 12)[None]
    perm = torch.tensor([6, 5, 4, 3, 2, 1, 0])
    with torch.no_grad():
        assert not torch.allclose(model(x).logits[:, perm], model(x[:, perm]).logits, atol=1e-5)


# ---------------------------------------------------------------------------------------- padding
def _padded(x: torch.Tensor, extra: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    pad = torch.zeros(1, extra, dtype=x.dtype)
    mask = torch.cat([torch.ones_like(x, dtype=torch.bool), torch.zeros(1, extra, dtype=torch.bool)], dim=1)
    if left:
        return torch.cat([pad, x], dim=1), mask.flip(1)
    return torch.cat([x, pad], dim=1), mask


@settings(max_examples=10)
@given(config=decoder_configs(), extra=st.integers(1, 4), left=st.booleans(), seed=st.integers(0, 2**16))
def test_decoder_lm_padding_invariance(config, extra, left, seed):
    torch.manual_seed(seed)
    model = DecoderLM(config).eval()
    x = ids(1, 6)
    padded, mask = _padded(x, extra, left)
    with torch.no_grad():
        alone = model(x).logits
        batch = model(torch.cat([padded, ids(1, 6 + extra)]), torch.cat([mask, torch.ones_like(mask)])).logits
    close(batch[:1][mask], alone[0])


@settings(max_examples=10)
@given(config=encoder_configs(), extra=st.integers(1, 4), left=st.booleans(), seed=st.integers(0, 2**16))
def test_encoder_lm_padding_invariance(config, extra, left, seed):
    torch.manual_seed(seed)
    model = EncoderLM(config).eval()
    x = ids(1, 6)
    padded, mask = _padded(x, extra, left)
    with torch.no_grad():
        alone = model(x).logits
        batch = model(torch.cat([padded, ids(1, 6 + extra)]), torch.cat([mask, torch.ones_like(mask)])).logits
    close(batch[:1][mask], alone[0])


@settings(max_examples=10)
@given(config=seq2seq_configs(), extra=st.integers(1, 3), left=st.booleans(), seed=st.integers(0, 2**16))
def test_seq2seq_padding_invariance(config, extra, left, seed):
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(config).eval()
    src, tgt = ids(1, 5), ids(1, 4)
    src_p, src_m = _padded(src, extra, left)
    tgt_p, tgt_m = _padded(tgt, extra, left)
    with torch.no_grad():
        alone = model(src, tgt).logits
        batch = model(
            torch.cat([src_p, ids(1, 5 + extra)]), torch.cat([tgt_p, ids(1, 4 + extra)]),
            torch.cat([src_m, torch.ones_like(src_m)]), torch.cat([tgt_m, torch.ones_like(tgt_m)]),
        ).logits
    close(batch[:1][tgt_m], alone[0])


# ---------------------------------------------------------------------------------------- backends
@pytest.mark.parametrize("family", ["decoder", "encoder", "seq2seq"])
@settings(max_examples=5)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_backends_agree_in_every_model(family, data, seed):
    torch.manual_seed(seed)
    strategy = {"decoder": decoder_configs, "encoder": encoder_configs, "seq2seq": seq2seq_configs}[family]
    config = data.draw(strategy(backend="math"))
    model = {"decoder": DecoderLM, "encoder": EncoderLM, "seq2seq": Seq2SeqTransformer}[family](config).eval()
    x = ids(2, 7)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, 5:] = False
    args = (x, x, mask, mask) if family == "seq2seq" else (x, mask)
    with torch.no_grad():
        reference = model(*args).logits
        for backend in BACKENDS:
            model.set_attention_backend(backend)
            assert model.config.attention_backend == backend
            assert all(m.backend == backend for m in model.modules() if isinstance(m, blocks.MultiHeadAttention))
            # Configs without a norm (norm="identity") reach logits of tens to hundreds: rounding scales with them.
            close(model(*args).logits, reference, atol=1e-5 * float(reference.abs().max().clamp_min(1.0)))


def test_set_attention_backend_rejects_unknown_name_and_changes_nothing():
    model = DecoderLM(DecoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32))
    with pytest.raises(ValueError, match="nope"):
        model.set_attention_backend("nope")
    assert model.config.attention_backend == "sdpa"


# ---------------------------------------------------------------------------------------- outputs & losses
def test_outputs_hidden_states_and_attentions():
    config = Seq2SeqConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2, n_decoder_layers=3)
    model = Seq2SeqTransformer(config).eval()
    out = model(ids(2, 5), ids(2, 4), output_hidden_states=True, output_attentions=True)
    assert out.logits.shape == (2, 4, VOCAB)
    assert len(out.encoder_hidden_states) == 3 and len(out.hidden_states) == 4
    assert [a.shape for a in out.encoder_attentions] == [(2, 2, 5, 5)] * 2
    assert [a.shape for a in out.attentions] == [(2, 2, 4, 4)] * 3
    assert [a.shape for a in out.cross_attentions] == [(2, 2, 4, 5)] * 3
    # Causal self-attention: no weight on future positions; every row sums to one.
    assert torch.all(out.attentions[0].triu(1) == 0)
    close(out.attentions[0].sum(-1), torch.ones(2, 2, 4))
    close(out.encoder_last_hidden_state, out.encoder_hidden_states[-1])

    lm = DecoderLM(DecoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=4, d_ff=32, n_layers=2)).eval()
    out = lm(ids(1, 6), output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2 and out.attentions[1].shape == (1, 4, 6, 6)
    close(lm.lm_head(out.hidden_states[-1]), out.logits)
    plain = lm(ids(1, 6))
    assert plain.hidden_states is None and plain.attentions is None and plain.loss is None


def test_decoder_lm_loss_is_next_token_prediction():
    model = DecoderLM(DecoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32)).eval()
    x = ids(2, 7)
    labels = x.clone()
    labels[0, 3] = -100
    out = model(x, labels=labels)
    logits, target = out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)
    keep = target != -100
    close(out.loss, torch.nn.functional.cross_entropy(logits[keep], target[keep]))


@pytest.mark.parametrize("positional", POSITIONALS)
def test_decoder_lm_packed_documents_equal_each_document_alone(positional):
    model = DecoderLM(DecoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, dropout=0.0,
                                      positional=positional)).eval()
    docs = [ids(1, 3), ids(1, 5), ids(1, 2)]
    packed = torch.cat(docs, dim=1)
    document_ids = torch.tensor([[0] * 3 + [1] * 5 + [2] * 2])
    with torch.no_grad():
        out = model(packed, document_ids=document_ids).logits
        alone = torch.cat([model(d).logits for d in docs], dim=1)
    close(out, alone)
    with pytest.raises(ValueError, match="document_ids must have shape"):
        model(packed, document_ids=document_ids[:, :4])


def test_decoder_lm_logits_to_keep_projects_only_the_last_positions():
    model = DecoderLM(DecoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32)).eval()
    x = ids(2, 7)
    full = model(x).logits
    close(model(x, logits_to_keep=2).logits, full[:, -2:])
    with pytest.raises(ValueError, match="logits_to_keep must be >= 0"):
        model(x, logits_to_keep=-1)
    with pytest.raises(ValueError, match="cannot be combined with labels"):
        model(x, labels=x, logits_to_keep=1)


def test_encoder_lm_loss_covers_only_labelled_positions():
    model = EncoderLM(EncoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32)).eval()
    x = ids(2, 7)
    labels = torch.full_like(x, -100)
    labels[0, 2], labels[1, 5] = 7, 9
    out = model(x, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits[[0, 1], [2, 5]], torch.tensor([7, 9]))
    close(out.loss, expected)


def test_seq2seq_loss_aligned_with_targets():
    model = Seq2SeqTransformer(Seq2SeqConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32)).eval()
    src, tgt = ids(2, 5), ids(2, 4)
    out = model(src, tgt, labels=tgt)
    close(out.loss, torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), tgt.reshape(-1)))
    close(model.decode(model.encode(src), tgt), out.logits)


def test_encoder_lm_masked_only_gives_the_same_loss_and_gradients():
    model = EncoderLM(EncoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32)).eval()
    x = ids(2, 7)
    labels = torch.full_like(x, -100)
    labels[0, 1], labels[0, 4], labels[1, 6] = 7, 8, 9
    full = model(x, labels=labels)
    full.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sparse = model(x, labels=labels, masked_only=True)
    sparse.loss.backward()
    assert sparse.logits.shape == (3, VOCAB)
    close(sparse.logits, full.logits[labels != -100])
    close(sparse.loss, full.loss)
    for g, p in zip(grads, model.parameters(), strict=True):
        close(p.grad, g)
    with pytest.raises(ValueError, match="masked_only=True needs labels"):
        model(x, masked_only=True)


def test_encoder_lm_segments_change_the_output():
    model = EncoderLM(EncoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32)).eval()
    x = ids(1, 6)
    segments = torch.tensor([[0, 0, 0, 1, 1, 1]])
    close(model(x).logits, model(x, token_type_ids=torch.zeros_like(x)).logits)
    assert not torch.allclose(model(x).logits, model(x, token_type_ids=segments).logits)


# ---------------------------------------------------------------------------------------- the paper's model
def test_seq2seq_shares_one_matrix_and_scales_embeddings():
    config = Seq2SeqConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, dropout=0.0)
    model = Seq2SeqTransformer(config).eval()
    assert model.src_embed.weight is model.tgt_embed.weight is model.lm_head.weight
    assert isinstance(model.encoder_layers[0].self_attn_sublayer, blocks.get("sublayer", "post_norm"))
    src = ids(1, 5)
    out = model(src, ids(1, 3), output_hidden_states=True)
    positions = torch.arange(5)[None]
    expected = model.encoder_positional(model.src_embed(src) * math.sqrt(16), positions)  # §3.4 and §3.5
    close(out.encoder_hidden_states[0], expected)
    separate = Seq2SeqTransformer(config.replace(share_embeddings=False, tie_embeddings=False))
    assert separate.src_embed.weight is not separate.tgt_embed.weight
    assert separate.lm_head.weight is not separate.tgt_embed.weight


def test_language_models_tie_output_to_input_embedding():
    lm = DecoderLM(DecoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32))
    assert lm.lm_head.weight is lm.embed_tokens.weight
    mlm = EncoderLM(EncoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32))
    assert mlm.mlm_head.decoder.weight is mlm.embed_tokens.weight
    untied = DecoderLM(DecoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed_tokens.weight


# Table 3 of the paper: (overrides, parameters in millions), shared 37,000-token vocabulary.
TABLE_3 = [
    ("base", {}, 65),
    ("base", {"d_head": 16, "d_value": 64}, 58),
    ("base", {"d_head": 32, "d_value": 64}, 60),
    ("base", {"n_encoder_layers": 2, "n_decoder_layers": 2}, 36),
    ("base", {"n_encoder_layers": 4, "n_decoder_layers": 4}, 50),
    ("base", {"n_encoder_layers": 8, "n_decoder_layers": 8}, 80),
    ("base", {"d_model": 256, "d_head": 32}, 28),
    ("base", {"d_model": 1024, "d_head": 128}, 168),
    ("base", {"d_ff": 1024}, 53),
    ("base", {"d_ff": 4096}, 90),
    ("big", {}, 213),
]


@pytest.mark.parametrize(("preset", "overrides", "millions"), TABLE_3)
def test_table_3_parameter_counts(preset, overrides, millions):
    config = Seq2SeqTransformer.preset_config(preset, **overrides)
    with torch.device("meta"):
        model = Seq2SeqTransformer(config)
    count = model.num_parameters()
    expected = millions * 1e6
    assert abs(count - expected) <= max(3e6, 0.05 * expected), f"{count / 1e6:.1f}M vs Table 3's {millions}M"


def test_presets_exist_with_the_papers_hyperparameters():
    base = Seq2SeqTransformer.preset_config("base")
    assert (base.n_encoder_layers, base.n_decoder_layers, base.d_model, base.d_ff, base.n_heads, base.dropout) == (
        6, 6, 512, 2048, 8, 0.1)
    big = Seq2SeqTransformer.preset_config("big")
    assert (big.d_model, big.d_ff, big.n_heads, big.dropout) == (1024, 4096, 16, 0.3)
    for cls in (Seq2SeqTransformer, EncoderLM, DecoderLM):
        tiny = cls.preset_config("tiny")
        assert tiny.d_model <= 64
    with torch.device("meta"):
        assert abs(EncoderLM.from_preset("bert-base").num_parameters() - 110e6) < 2e6
        assert abs(DecoderLM.from_preset("gpt2-small").num_parameters() - 124.4e6) < 1e6
    with pytest.raises(ValueError, match="gpt2-small"):
        DecoderLM.from_preset("gpt5")


@pytest.mark.parametrize("cls", [DecoderLM, EncoderLM, Seq2SeqTransformer])
def test_positional_none_works_in_every_model(cls):
    model = cls.from_preset("tiny", positional="none", vocab_size=VOCAB).eval()
    x = ids(2, 5)
    out = model(x, x) if cls is Seq2SeqTransformer else model(x)
    assert out.logits.shape == (2, 5, VOCAB) and torch.isfinite(out.logits).all()
