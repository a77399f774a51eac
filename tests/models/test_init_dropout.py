"""Dropout inside the models and their initialisation, checked statistically (fixed seeds, generous bounds).

Dropout: every site is isolated by setting weights so that only the site under test can vary the output, then
a training-mode forward is compared with an eval-mode one. An element (or, for attention, a key) is dropped
with probability p and the kept ones are scaled by 1/(1-p); each config field must reach its sites:
``dropout`` the embeddings and every residual branch, ``attention_dropout`` every attention.

Initialisation: the distributions the class docstrings promise (Xavier-uniform and N(0, d_model^-1/2)
embeddings for the paper's model, N(0, 0.02) for BERT, N(0, 0.02) with the residual projections at
0.02 / sqrt(2 N) for GPT-2), checked by standard deviation, range and shape (kurtosis: 1.8 uniform, 3 normal).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import blocks
from models import DecoderLM, DecoderLMConfig, EncoderLM, EncoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer

P = 0.4  # the dropout rate under test
B, L, S = 8, 32, 24  # batch, (target) length, source length
D = 16  # d_model


def build(family: str, **overrides: Any) -> nn.Module:
    """A small model of the family with two layers per stack (so ``hidden_states[1]`` is a raw layer output)."""
    common = dict(vocab_size=50, d_model=D, n_heads=2, d_ff=32, max_len=64, dropout=0.0, attention_dropout=0.0)
    common.update(overrides)
    if family == "seq2seq":
        return Seq2SeqTransformer(Seq2SeqConfig(n_encoder_layers=2, n_decoder_layers=2, **common))
    if family == "encoder":
        return EncoderLM(EncoderLMConfig(n_layers=2, **common))
    return DecoderLM(DecoderLMConfig(n_layers=2, **common))


def stacks(family: str) -> list[str]:
    return ["encoder", "decoder"] if family == "seq2seq" else ["layers"]


def hidden_states(model: nn.Module, family: str, stack: str, gen: torch.Generator) -> tuple[Tensor, ...]:
    """The hidden states of one stack (embedding output first) on a fixed random batch."""
    ids = torch.randint(5, 50, (B, L), generator=gen)
    if family == "seq2seq":
        src = torch.randint(5, 50, (B, S), generator=gen)
        out = model(src, ids, output_hidden_states=True)
        return out.encoder_hidden_states if stack == "encoder" else out.hidden_states
    return model(ids, output_hidden_states=True).hidden_states


def train_and_eval(model: nn.Module, family: str, stack: str, index: int) -> tuple[Tensor, Tensor]:
    """``hidden_states[index]`` of the same batch in training mode and in eval mode."""
    with torch.no_grad():
        model.train()
        trained = hidden_states(model, family, stack, torch.Generator().manual_seed(1))[index]
        model.eval()
        evaluated = hidden_states(model, family, stack, torch.Generator().manual_seed(1))[index]
    return trained, evaluated


def layer(model: nn.Module, family: str, stack: str) -> nn.Module:
    """The first layer of a stack."""
    if family == "seq2seq":
        return model.encoder_layers[0] if stack == "encoder" else model.decoder_layers[0]
    return model.layers[0]


def silence(model: nn.Module) -> None:
    """Every parameter 0 except norm scales (1): embeddings, attention and FFNs all output zeros."""
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for module in model.modules():
            if "norm" in type(module).__name__.lower() and isinstance(getattr(module, "weight", None), nn.Parameter):
                module.weight.fill_(1.0)


def assert_drop_rate(dropped: Tensor, total: int) -> None:
    """``dropped`` elements of ``total`` were dropped: within ~4 standard deviations of p."""
    rate = float(dropped) / total
    sd = math.sqrt(P * (1 - P) / total)
    assert abs(rate - P) < max(4 * sd, 0.02), f"dropped {rate:.3f} of {total}, expected {P}"


FAMILIES = ["seq2seq", "encoder", "decoder"]
STACKS = [(f, s) for f in FAMILIES for s in stacks(f)]


# ---------------------------------------------------------------------------------------------- embeddings
@pytest.mark.parametrize(("family", "stack"), STACKS)
def test_embedding_dropout_comes_from_config_dropout(family: str, stack: str) -> None:
    torch.manual_seed(0)
    model = build(family, dropout=P)
    trained, evaluated = train_and_eval(model, family, stack, 0)  # the embedding output, after dropout
    kept = trained != 0
    assert_drop_rate((~kept & (evaluated != 0)).sum(), int((evaluated != 0).sum()))
    torch.testing.assert_close(trained[kept], evaluated[kept] / (1 - P), rtol=1e-5, atol=1e-6)
    # attention_dropout alone leaves the embeddings alone.
    trained, evaluated = train_and_eval(build(family, attention_dropout=P), family, stack, 0)
    assert torch.equal(trained, evaluated)


# ---------------------------------------------------------------------------------------------- residual branches
def residual_sites(family: str, stack: str) -> list[str]:
    sites = ["self_attn.o_proj", "ffn.down_proj"]
    if family == "seq2seq" and stack == "decoder":
        sites.insert(1, "cross_attn.o_proj")
    return sites


@pytest.mark.parametrize("sublayer", ["post_norm", "pre_norm"])
@pytest.mark.parametrize(("family", "stack", "site"), [(f, s, x) for f, s in STACKS for x in residual_sites(f, s)])
def test_residual_dropout_on_every_branch_comes_from_config_dropout(family: str, stack: str, site: str,
                                                                    sublayer: str) -> None:
    # All weights are zero, so the stack's input is 0 and every branch outputs 0, except the branch under test,
    # whose output projection's bias makes it output c * e_0 at every position. After the first layer a row is
    # then c * e_0 / (1 - p) (pre-norm) or norm(e_0) (post-norm) where the branch was kept, and 0 where dropout
    # removed it (a zero vector stays zero through a norm).
    torch.manual_seed(0)
    model = build(family, dropout=P, sublayer=sublayer, positional="none")
    silence(model)
    branch = layer(model, family, stack).get_submodule(site)
    with torch.no_grad():
        branch.bias[0] = 3.0
    trained, evaluated = train_and_eval(model, family, stack, 1)
    rows_eval, rows = evaluated.reshape(-1, D), trained.reshape(-1, D)
    assert bool((rows_eval.abs().sum(-1) > 0.5).all())  # the branch reaches the output in eval mode
    dropped = rows.abs().sum(-1) == 0
    assert_drop_rate(dropped.sum(), rows.shape[0])
    scale = 1 / (1 - P) if sublayer == "pre_norm" else 1.0  # a norm after the sum removes the scale
    torch.testing.assert_close(rows[~dropped], rows_eval[~dropped] * scale, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- attention
def attention_sites(family: str, stack: str) -> list[str]:
    return ["self_attn", "cross_attn"] if family == "seq2seq" and stack == "decoder" else ["self_attn"]


@pytest.mark.parametrize("backend", [b for b in blocks.names("attention_backend") if b != "flex"])
@pytest.mark.parametrize(("family", "stack", "site"), [(f, s, x) for f, s in STACKS for x in attention_sites(f, s)])
def test_attention_dropout_comes_from_config_attention_dropout(family: str, stack: str, site: str,
                                                               backend: str) -> None:
    # Zero queries and keys attend uniformly; values are all ones and o_proj is the identity, so a query with
    # n allowed keys outputs (kept keys) / (n (1 - p)) in every dimension of each head, and exactly 1 in eval.
    torch.manual_seed(0)
    model = build(family, attention_dropout=P, sublayer="pre_norm", positional="none", attention_backend=backend)
    silence(model)
    attention = layer(model, family, stack).get_submodule(site)
    with torch.no_grad():
        attention.v_proj.bias.fill_(1.0)
        attention.o_proj.weight.copy_(torch.eye(D))
    trained, evaluated = train_and_eval(model, family, stack, 1)
    torch.testing.assert_close(evaluated, torch.ones_like(evaluated))
    queries = trained.shape[1]
    if site == "cross_attn":
        n_keys = torch.full((queries,), S)  # every source position
    elif family == "encoder" or stack == "encoder":
        n_keys = torch.full((queries,), queries)  # bidirectional
    else:
        n_keys = torch.arange(1, queries + 1)  # causal: query i sees i + 1 keys
    kept = trained * (1 - P) * n_keys[None, :, None].float()  # (B, L, D): kept keys per query and head
    torch.testing.assert_close(kept, kept.round(), atol=1e-3, rtol=0)  # whole keys are dropped
    per_head = kept.reshape(B, -1, 2, D // 2)
    assert bool((per_head == per_head[..., :1]).all())  # one count per head, shared by its dimensions
    total_keys = int(n_keys.sum()) * B * 2
    assert_drop_rate(total_keys - per_head[..., 0].sum().round(), total_keys)
    # dropout alone leaves attention weights alone: the silenced model's output is unchanged.
    model = build(family, dropout=P, sublayer="pre_norm", positional="none", attention_backend=backend)
    silence(model)
    attention = layer(model, family, stack).get_submodule(site)
    with torch.no_grad():
        attention.v_proj.bias.fill_(1.0)
        attention.o_proj.weight.copy_(torch.eye(D))
    trained, _ = train_and_eval(model, family, stack, 1)
    # Residual dropout still acts on the branch as a whole (all of a row's elements independently): any kept
    # element is exactly 1 / (1 - p), never a fraction of the keys.
    values = trained[trained != 0]
    torch.testing.assert_close(values, torch.full_like(values, 1 / (1 - P)))


# ---------------------------------------------------------------------------------------------- initialisation
def kurtosis(x: Tensor) -> float:
    x = x.detach().double().flatten()
    x = x - x.mean()
    return float((x**4).mean() / (x**2).mean() ** 2)


def assert_normal(x: Tensor, std: float, name: str) -> None:
    x = x.detach()
    assert abs(float(x.double().mean())) < 4 * std / math.sqrt(x.numel()) + 1e-9, name
    assert float(x.double().std()) == pytest.approx(std, rel=0.06), name
    assert 2.6 < kurtosis(x) < 3.4, name  # bell-shaped, not uniform (1.8)


def assert_xavier_uniform(w: Tensor, name: str) -> None:
    w = w.detach()
    fan_out, fan_in = w.shape[0], w[0].numel()
    bound = math.sqrt(6 / (fan_in + fan_out))
    assert float(w.abs().max()) <= bound, name
    assert float(w.abs().max()) > 0.97 * bound, name  # fills the whole range
    assert float(w.double().std()) == pytest.approx(bound / math.sqrt(3), rel=0.05), name
    assert 1.6 < kurtosis(w) < 2.0, name  # flat, not bell-shaped (3)


def assert_biases_and_norms(model: nn.Module) -> None:
    norms = {id(m.weight) for m in model.modules()
             if "norm" in type(m).__name__.lower() and isinstance(getattr(m, "weight", None), nn.Parameter)}
    for name, p in model.named_parameters():
        if id(p) in norms:
            assert bool((p == 1).all()), name
        elif name.endswith("bias"):
            assert bool((p == 0).all()), name


def test_seq2seq_init_is_xavier_uniform_with_normal_embeddings() -> None:
    torch.manual_seed(0)
    d = 64
    model = Seq2SeqTransformer(Seq2SeqConfig(vocab_size=1000, d_model=d, n_heads=4, d_ff=256, n_encoder_layers=1,
                                             n_decoder_layers=1))
    embedding = model.src_embed.weight
    assert_normal(embedding, d**-0.5, "embedding")  # scaled by sqrt(d_model): unit variance (§3.4)
    matrices = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2 and p is not embedding]
    assert len(matrices) == 2 * 6 + 4  # q/k/v/o + up/down per layer, plus the decoder's cross-attention
    for name, p in matrices:
        assert_xavier_uniform(p, name)
    assert_biases_and_norms(model)
    # Without shared embeddings the target embedding is drawn the same way.
    untied = Seq2SeqTransformer(Seq2SeqConfig(vocab_size=1000, d_model=d, n_heads=4, d_ff=256, n_encoder_layers=1,
                                              n_decoder_layers=1, share_embeddings=False))
    assert_normal(untied.tgt_embed.weight, d**-0.5, "tgt_embed")


def test_encoder_lm_init_is_normal_0_02() -> None:
    torch.manual_seed(0)
    model = EncoderLM(EncoderLMConfig(vocab_size=1000, d_model=64, n_heads=4, d_ff=256, n_layers=2, max_len=512))
    matrices = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    assert {n for n, _ in matrices} >= {"embed_tokens.weight", "positional.weight", "token_type_embed.weight"}
    for name, p in matrices:
        if name == "token_type_embed.weight":  # 2 x 64 values: too few for a shape test
            assert float(p.detach().std()) == pytest.approx(0.02, rel=0.3)
            continue
        assert_normal(p, 0.02, name)
    assert_biases_and_norms(model)


def test_decoder_lm_init_is_normal_0_02_with_scaled_residual_projections() -> None:
    torch.manual_seed(0)
    n_layers = 8
    model = DecoderLM(DecoderLMConfig(vocab_size=1000, d_model=64, n_heads=4, d_ff=256, n_layers=n_layers,
                                      max_len=512))
    residual_std = 0.02 / math.sqrt(2 * n_layers)  # GPT-2: 1 / sqrt(2 N) for the projections into the stream
    residual = [p for n, p in model.named_parameters() if n.endswith(("o_proj.weight", "down_proj.weight"))]
    assert len(residual) == 2 * n_layers
    assert_normal(torch.cat([p.flatten() for p in residual]), residual_std, "residual projections")
    for p in residual:
        assert float(p.detach().std()) == pytest.approx(residual_std, rel=0.15)
    others = [(n, p) for n, p in model.named_parameters()
              if p.dim() >= 2 and not n.endswith(("o_proj.weight", "down_proj.weight"))]
    assert {n for n, _ in others} >= {"embed_tokens.weight", "positional.weight", "layers.0.ffn.up_proj.weight"}
    for name, p in others:
        assert_normal(p, 0.02, name)
    assert_biases_and_norms(model)
