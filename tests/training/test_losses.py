"""Label-smoothed cross-entropy: equal to torch's where they overlap, padding ignored, the paper's variant."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import SEEDS, randn
from training import LabelSmoothedCrossEntropy, MaskedTokenLoss, TokenLoss, label_smoothed_cross_entropy


@given(
    st.integers(1, 4), st.integers(1, 6), st.integers(2, 12), st.sampled_from([0.0, 0.1, 0.3, 0.9]),
    st.sampled_from(["mean", "sum", "none"]), SEEDS,
)
def test_matches_torch_cross_entropy_with_label_smoothing(b: int, length: int, c: int, eps: float, reduction: str,
                                                          seed: int) -> None:
    logits = randn((b, length, c), seed, scale=3.0, requires_grad=True)
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, c, (b, length), generator=g)
    target[torch.rand(b, length, generator=g) < 0.3] = -100
    if reduction == "mean" and (target == -100).all():
        target[0, 0] = 0  # torch gives NaN with no target; ours gives 0 (tested below)
    ours = label_smoothed_cross_entropy(logits, target, eps, reduction=reduction)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, c), target.reshape(-1), label_smoothing=eps,
                                            ignore_index=-100, reduction=reduction)
    torch.testing.assert_close(ours.reshape(-1), ref.reshape(-1), rtol=1e-5, atol=1e-6)
    (g_ours,) = torch.autograd.grad(ours.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-6)


def test_padding_positions_contribute_nothing() -> None:
    logits = torch.randn(2, 5, 7)
    target = torch.tensor([[1, 2, -100, -100, -100], [3, -100, -100, -100, -100]])
    full = label_smoothed_cross_entropy(logits, target, 0.1)
    kept = label_smoothed_cross_entropy(logits[target != -100], target[target != -100], 0.1)
    torch.testing.assert_close(full, kept)
    logits2 = logits.clone()
    logits2[target == -100] = 1e4 * torch.randn_like(logits2[target == -100])
    torch.testing.assert_close(label_smoothed_cross_entropy(logits2, target, 0.1), full)
    none = label_smoothed_cross_entropy(logits, target, 0.1, reduction="none")
    assert (none[target == -100] == 0).all()
    empty = label_smoothed_cross_entropy(logits, torch.full((2, 5), -100), 0.1)
    assert empty.item() == 0.0 and not math.isnan(empty.item())


def test_excluding_padding_from_smoothing_is_the_annotated_transformers_distribution() -> None:
    # Target distribution: 1 - eps on the true class, eps spread over the C - 1 classes other than padding.
    c, pad, eps = 6, 0, 0.2
    logits = torch.randn(4, c)
    target = torch.tensor([1, 2, 3, 5])
    dist = torch.full((4, c), eps / (c - 1))
    dist[:, pad] = 0.0
    dist[torch.arange(4), target] += 1 - eps
    expected = -(dist * torch.log_softmax(logits, -1)).sum(-1).mean()
    ours = label_smoothed_cross_entropy(logits, target, eps, exclude_from_smoothing=pad)
    torch.testing.assert_close(ours, expected)
    module = LabelSmoothedCrossEntropy(eps, exclude_from_smoothing=pad)
    torch.testing.assert_close(module(logits, target), expected)


def test_epsilon_zero_is_plain_cross_entropy_and_minimum_is_smoothed() -> None:
    logits = torch.randn(3, 5)
    target = torch.tensor([0, 4, 2])
    torch.testing.assert_close(label_smoothed_cross_entropy(logits, target, 0.0),
                               torch.nn.functional.cross_entropy(logits, target))
    # The loss is smallest when the prediction equals the smoothed target, not the one-hot.
    eps, c = 0.1, 5
    smoothed = torch.full((1, c), eps / c)
    smoothed[0, 2] += 1 - eps
    at_smoothed = label_smoothed_cross_entropy(smoothed.log(), torch.tensor([2]), eps)
    confident = torch.full((1, c), -20.0)
    confident[0, 2] = 0.0
    assert at_smoothed < label_smoothed_cross_entropy(confident, torch.tensor([2]), eps)


def test_token_loss_sums_and_counts_with_and_without_shift() -> None:
    class Echo(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return type("Out", (), {"logits": torch.nn.functional.one_hot(input_ids, 9).float() * 5})()

    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.ones(1, 4, dtype=torch.bool),
             "labels": torch.tensor([[-100, 6, 7, -100]])}
    aligned, shifted = TokenLoss(), TokenLoss(shift=True)
    assert aligned.count(batch) == 2 and shifted.count(batch) == 2
    logits = Echo()(batch["input_ids"]).logits
    expected = torch.nn.functional.cross_entropy(logits[0, 1:3], torch.tensor([6, 7]), reduction="sum")
    torch.testing.assert_close(aligned(Echo(), batch), expected)
    expected_shift = torch.nn.functional.cross_entropy(logits[0, 0:2], torch.tensor([6, 7]), reduction="sum")
    torch.testing.assert_close(shifted(Echo(), batch), expected_shift)
    with pytest.raises(ValueError, match="no 'labels'"):
        aligned.count({"input_ids": batch["input_ids"]})


def test_masked_token_loss_equals_the_full_loss_on_an_encoder_lm() -> None:
    from models import EncoderLM

    model = EncoderLM.from_preset("tiny", vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_layers=1, dropout=0.0)
    ids = torch.randint(5, 40, (2, 7))
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[1, 5] = 9, 11
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool), "labels": labels}
    torch.testing.assert_close(MaskedTokenLoss()(model, batch), TokenLoss()(model, batch))


def test_bad_input_is_rejected() -> None:
    logits, target = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="epsilon"):
        label_smoothed_cross_entropy(logits, target, 1.0)
    with pytest.raises(ValueError, match="reduction"):
        label_smoothed_cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="do not match"):
        label_smoothed_cross_entropy(logits, target[:, :2])
    with pytest.raises(ValueError, match=r"target ids must be in \[0, 5\)"):
        label_smoothed_cross_entropy(logits, target + 5)
    with pytest.raises(ValueError, match="exclude_from_smoothing"):
        label_smoothed_cross_entropy(logits, target, exclude_from_smoothing=9)
    with pytest.raises(ValueError, match="label_smoothing"):
        TokenLoss(label_smoothing=-0.1)
