"""Preset names: one convention (lowercase, words joined by ``-``), found in any case and with ``_`` for ``-``; a
typo is refused with the closest names. Min-p filtering against its definition."""

from __future__ import annotations

import math

import pytest
import torch

from models import DecoderLM, EncoderLM
from models.core.presets import PresetTable, preset_key
from models.generation.sampling import SamplingParams, min_p_filter


@pytest.mark.parametrize("cls", [DecoderLM, EncoderLM])
def test_every_preset_name_follows_one_convention(cls) -> None:
    assert all(name == preset_key(name) and "_" not in name and name == name.lower() for name in cls.presets)


def test_any_spelling_finds_the_preset_and_a_typo_gets_did_you_mean() -> None:
    canonical = DecoderLM.presets["gpt-oss-tiny"]
    assert DecoderLM.presets["gpt_oss-tiny"] is canonical and DecoderLM.presets["GPT-OSS-Tiny"] is canonical
    assert "qwen3_moe-tiny" in DecoderLM.presets and DecoderLM.presets.get("nope") is None
    assert DecoderLM.preset_config("Llama-Tiny") == DecoderLM.preset_config("llama-tiny")
    with pytest.raises(ValueError, match=r"^unknown DecoderLM preset 'gpt-oss-tiy'; did you mean 'gpt-oss-tiny'"):
        DecoderLM.from_preset("gpt-oss-tiy")
    with pytest.raises(ValueError, match=r"^unknown EncoderLM preset 'zzz'; expected one of \['bert-base', "):
        EncoderLM.from_preset("zzz")
    with pytest.raises(ValueError, match="preset 'llama_tiny' already exists"):
        DecoderLM.register_preset("llama_tiny", dict(DecoderLM.presets["llama-tiny"]))
    table = PresetTable({"My_Model": {"d_model": 8}})
    assert list(table) == ["my-model"] and table["MY-model"] == {"d_model": 8}


def test_min_p_keeps_the_tokens_at_least_p_times_as_likely_as_the_best() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -5.0]])
    probs = logits.softmax(-1)
    for p in (0.0, 0.05, 0.3, 0.5, 1.0):
        kept = min_p_filter(logits, p).isfinite()
        assert kept.tolist() == (probs >= p * probs.max()).tolist()  # the definition, brute force
    sampler = SamplingParams(do_sample=True, temperature=2.0, min_p=0.3)
    tempered = (logits / 2.0).softmax(-1)
    assert (sampler.probabilities(logits) > 0).tolist() == (tempered >= 0.3 * tempered.max()).tolist()
    assert math.isclose(float(sampler.probabilities(logits).sum()), 1.0, rel_tol=1e-6)
    with pytest.raises(ValueError, match=r"min_p must be None or a number in \[0, 1\], got 1.5"):
        SamplingParams(min_p=1.5)
