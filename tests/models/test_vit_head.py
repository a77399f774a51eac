"""ViT's classifier is the registered ``image_classification`` head: built from the registry under ViT's name for
it, named in the config (round-tripped through JSON), its loss as before, other heads refused."""

from __future__ import annotations

import json

import pytest
import torch

import blocks
from blocks.heads import ImageClassificationHead
from models.vit import VisionTransformer, VisionTransformerConfig

FIELDS = dict(image_size=8, patch_size=2, num_channels=3, d_model=16, n_layers=1, n_heads=2, d_ff=32, num_labels=5)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_classifier_is_the_registered_head(pooling: str) -> None:
    assert blocks.get("head", "image_classification") is ImageClassificationHead
    config = VisionTransformerConfig(**FIELDS, pooling=pooling)
    assert config.head == "image_classification"
    again = VisionTransformerConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.to_dict()["head"] == "image_classification"
    model = VisionTransformer(config).eval()
    assert isinstance(model.classifier, ImageClassificationHead)
    assert set(dict(model.classifier.named_parameters())) == {"weight", "bias"}  # checkpoint names unchanged
    images = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    out = model(images, labels=torch.tensor([1, -100, 4]), output_hidden_states=True)
    last = out.hidden_states[-1]
    pooled = last[:, 0] if pooling == "cls" else last[:, 1:].mean(1)
    torch.testing.assert_close(out.logits, pooled @ model.classifier.weight.T + model.classifier.bias)
    # the cross entropy of the labelled images; none labelled: 0, not NaN
    expected = torch.nn.functional.cross_entropy(out.logits[[0, 2]], torch.tensor([1, 4]))
    torch.testing.assert_close(out.loss, expected)
    assert model(images, labels=torch.full((3,), -100)).loss.item() == 0.0


def test_heads_that_do_not_fit_a_vision_transformer_raise() -> None:
    with pytest.raises(ValueError, match="head 'sequence_classification' does not fit a VisionTransformer; "
                                         "expected one of \\['image_classification'\\]"):
        VisionTransformerConfig(**FIELDS, head="sequence_classification")
    with pytest.raises(ValueError, match="unknown pooling 'max'"):
        ImageClassificationHead(16, num_labels=3, pooling="max")
    with pytest.raises(ValueError, match="num_labels must be a positive integer, got 0"):
        ImageClassificationHead(16, num_labels=0)
