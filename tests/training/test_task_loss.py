"""The Trainer's default loss for a model with a task head: the problem type's loss (MSE / cross entropy / BCE,
-100 ignored, QA the mean of the start and end cross entropies), weighted across accumulated micro-batches so that a
step's loss is the loss of the whole step's batch computed at once."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.nn import functional as F

from models import DecoderLM, DecoderLMConfig, EncoderLM, EncoderLMConfig
from training import MaskedTokenLoss, TaskLoss, Trainer, TrainerConfig, default_loss

VOCAB, LENGTH, N = 40, 6, 8
SMALL = dict(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=16, dropout=0.0, pad_token_id=0)


def labels_for(case: str, gen: torch.Generator) -> torch.Tensor:
    return {
        "regression": lambda: torch.randn(N, generator=gen),
        # micro-batches with 3 and 4 labelled examples: the step weighs examples, not micro-batches
        "single_label": lambda: torch.tensor([0, 2, -100, 1, 1, 0, 2, 2]),
        "multi_label": lambda: torch.rand(N, 3, generator=gen).round(),
        "token": lambda: torch.randint(0, 3, (N, LENGTH), generator=gen).masked_fill(
            torch.rand(N, LENGTH, generator=gen) < 0.3, -100),
        "qa": lambda: torch.randint(0, LENGTH, (N, 2), generator=gen),
    }[case]()


def reference(case: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss of the whole batch at once, written out with torch's functional losses."""
    if case == "regression":
        return F.mse_loss(logits.squeeze(-1), labels)
    if case == "multi_label":
        return F.binary_cross_entropy_with_logits(logits, labels)
    if case == "qa":
        return (F.cross_entropy(logits[..., 0], labels[:, 0]) + F.cross_entropy(logits[..., 1], labels[:, 1])) / 2
    return F.cross_entropy(logits.reshape(-1, 3), labels.reshape(-1), ignore_index=-100)


CASES = [("encoder", "regression"), ("encoder", "single_label"), ("encoder", "multi_label"), ("encoder", "token"),
         ("encoder", "qa"), ("decoder", "single_label")]


@pytest.mark.parametrize(("kind", "case"), CASES)
def test_default_loss_of_a_task_head_is_its_problem_types_loss(kind: str, case: str) -> None:
    head = {"token": "token_classification", "qa": "question_answering"}.get(case, "sequence_classification")
    options = {} if case == "qa" else {"num_labels": 1 if case == "regression" else 3, "classifier_dropout": 0.0}
    cls, config_class = (EncoderLM, EncoderLMConfig) if kind == "encoder" else (DecoderLM, DecoderLMConfig)
    torch.manual_seed(0)
    model = cls(config_class(**SMALL, head=head, options={"head": options}))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (N, LENGTH), generator=gen)
    labels = labels_for(case, gen)
    with torch.no_grad():
        logits = model.eval()(ids).logits
        expected = reference(case, logits, labels).item()

    loss_fn = default_loss(model)
    assert isinstance(loss_fn, TaskLoss) and loss_fn.head == head
    data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(N)]
    trainer = Trainer(model, partial(torch.optim.SGD, lr=0.1),
                      TrainerConfig(max_steps=1, batch_size=N // 2, grad_accum_steps=2, shuffle=False,
                                    progress=False, device="cpu"),
                      data, lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]})
    history = trainer.train()
    assert history[0]["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_default_loss_elsewhere_and_bad_heads() -> None:
    assert isinstance(default_loss(EncoderLM(EncoderLMConfig(**SMALL))), MaskedTokenLoss)
    embedder = EncoderLM(EncoderLMConfig(**SMALL, head="embedding"))
    with pytest.raises(ValueError, match="the 'embedding' head has no loss of its own; pass the Trainer a loss_fn"):
        default_loss(embedder)
    with pytest.raises(ValueError, match="TaskLoss needs a task head with a loss.*got 'lm'"):
        TaskLoss("lm")
    # every label ignored: a zero loss with a gradient path, not NaN
    model = EncoderLM(EncoderLMConfig(**SMALL, head="sequence_classification", options={"head": {"num_labels": 3}}))
    batch = {"input_ids": torch.randint(3, VOCAB, (2, LENGTH)), "labels": torch.tensor([-100, -100])}
    loss = TaskLoss("sequence_classification")(model, batch)
    assert loss.item() == 0.0 and loss.requires_grad
