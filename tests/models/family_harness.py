"""Shared checks of a ``transformers`` family against the zoo: logits, greedy generation, export round trip.

Each family's test file builds a tiny randomly initialised ``transformers`` model (odd vocabulary, GQA where the
family has it, sequences longer than its window) and calls these checks; the reference is always ``transformers``
itself, never the zoo.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor, nn

import models
from models.convert import from_transformers, save_transformers
from models.convert.registry import Converted

ATOL = 1e-4


def build_hf(config_class: str, model_class: str, seed: int = 1234, scale: float = 0.1, **config: Any) -> nn.Module:
    """A ``transformers`` model with every parameter perturbed (norm weights and biases too), in eval mode, fp32."""
    cfg = getattr(transformers, config_class)(**config)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model.float().eval()


def convert_via_folder(hf_model: nn.Module, tmp_path: Path) -> nn.Module:
    """Save the ``transformers`` model as a checkpoint folder and load it with ``models.from_pretrained``."""
    folder = tmp_path / "hf"
    hf_model.save_pretrained(folder)
    return models.from_pretrained(folder).eval()


def from_live(hf_model: nn.Module) -> tuple[nn.Module, Converted]:
    """The zoo model converted from a live ``transformers`` model's in-memory state dict (fused experts, as
    ``transformers`` 5 holds them), in eval mode, and the conversion it was built from."""
    converted = from_transformers(hf_model.config.to_dict(), hf_model.state_dict())
    zoo = converted.architecture(converted.config).eval()
    zoo.load_state_dict(converted.state_dict)
    return zoo, converted


def left_padded(vocab: int, length: int, seed: int = 0, pad: int = 3) -> tuple[Tensor, Tensor]:
    """``(ids (2, length), mask)``: row 1 is left-padded by ``pad`` positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, length), generator=gen)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :pad] = 0
    return ids, mask


def right_padded(vocab: int, length: int, seed: int = 0, pad: int = 3, low: int = 0) -> tuple[Tensor, Tensor]:
    """``(ids (2, length), mask)``: row 1 is right-padded by ``pad`` positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab, (2, length), generator=gen)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, length - pad:] = 0
    return ids, mask


def assert_logits_close(expected: Tensor, actual: Tensor, mask: Tensor | None = None, atol: float = ATOL) -> None:
    """Logits equal within ``atol`` at the real (mask = 1) positions."""
    assert expected.shape == actual.shape, (expected.shape, actual.shape)
    if mask is not None:
        expected, actual = expected[mask.bool()], actual[mask.bool()]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


@torch.no_grad()
def check_decoder_family(hf_model: nn.Module, tmp_path: Path, vocab: int, length: int = 24,
                         new_tokens: int = 20, backends: tuple[str, ...] = ("sdpa", "math")) -> nn.Module:
    """A causal LM family: logits (plain and left-padded batch) under each backend, 20 greedy tokens equal to
    ``transformers.generate`` (left-padded batch), and the export loading back into ``transformers`` with the same
    logits. Returns the zoo model."""
    zoo = convert_via_folder(hf_model, tmp_path)
    assert isinstance(zoo, models.DecoderLM)
    ids, mask = left_padded(vocab, length)
    plain = hf_model(input_ids=ids).logits
    padded = hf_model(input_ids=ids, attention_mask=mask).logits
    for backend in backends:
        zoo.set_attention_backend(backend)
        assert_logits_close(plain, zoo(ids).logits)
        assert_logits_close(padded, zoo(ids, attention_mask=mask.bool()).logits, mask)
    zoo.set_attention_backend("sdpa")

    prompt, prompt_mask = left_padded(vocab, 6, seed=1, pad=2)
    expected = hf_model.generate(
        input_ids=prompt, attention_mask=prompt_mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=0, eos_token_id=None,
    )
    actual = zoo.generate(prompt, attention_mask=prompt_mask.bool(), max_new_tokens=new_tokens, eos_token_id=None,
                          pad_token_id=0)
    assert torch.equal(actual[:, prompt.shape[1]:], expected[:, prompt.shape[1]:]), (actual, expected)

    check_export(zoo, type(hf_model), tmp_path, lambda m: m(input_ids=ids).logits, plain)
    return zoo


@torch.no_grad()
def check_encoder_family(hf_model: nn.Module, tmp_path: Path, vocab: int, length: int = 24, low: int = 0,
                         backends: tuple[str, ...] = ("sdpa", "math")) -> nn.Module:
    """A masked LM family: logits (plain and right-padded) under each backend, and the export round trip."""
    zoo = convert_via_folder(hf_model, tmp_path)
    assert isinstance(zoo, models.EncoderLM)
    ids, mask = right_padded(vocab, length, low=low)
    plain = hf_model(input_ids=ids).logits
    padded = hf_model(input_ids=ids, attention_mask=mask).logits
    for backend in backends:
        zoo.set_attention_backend(backend)
        assert_logits_close(plain, zoo(ids).logits)
        assert_logits_close(padded, zoo(ids, attention_mask=mask.bool()).logits, mask)
    zoo.set_attention_backend("sdpa")
    check_export(zoo, type(hf_model), tmp_path, lambda m: m(input_ids=ids).logits, plain)
    return zoo


def check_export(zoo: nn.Module, hf_class: type[nn.Module], tmp_path: Path, run: Any, expected: Tensor) -> None:
    """``save_transformers(zoo)`` loads into ``hf_class`` and gives ``expected`` from ``run(model)``."""
    # Name the family: a model may be representable by several (a Phi-3 is also a Llama).
    folder = save_transformers(zoo, tmp_path / "exported", model_type=hf_class.config_class.model_type)
    reloaded = hf_class.from_pretrained(folder).float().eval()
    assert_logits_close(expected, run(reloaded))
