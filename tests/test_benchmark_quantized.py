"""``benchmarks.quantized``: its shapes are the real models', and the files it writes are GGUF files llama.cpp can
load (a vocabulary included) that the zoo loads packed."""

from __future__ import annotations

import gguf
import pytest

import models
from benchmarks import quantized, thin
from blocks.quantized import QuantizedEmbedding, quantized_modules
from models import DecoderLMConfig


def test_shapes_are_the_thin_benchmarks_real_models() -> None:
    for ours, theirs in (("smollm2", "smollm2-135m"), ("qwen3", "qwen3-0.6b")):
        real = DecoderLMConfig.from_dict({**thin.SHAPES[theirs], "max_len": 1024})
        assert quantized.SHAPES[ours] == {k: getattr(real, k) for k in quantized.SHAPES[ours]}


def test_a_written_file_has_a_vocabulary_and_loads_packed(tmp_path) -> None:
    path = quantized.build_file("tiny", "Q4_0", tmp_path)
    reader = gguf.GGUFReader(path)
    assert "tokenizer.ggml.model" in reader.fields  # llama.cpp refuses a file without it
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == quantized.SHAPES["tiny"]["vocab_size"]
    model = models.from_pretrained(path)
    assert set(quantized_modules(model).values()) == {"q4_0"}
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.lm_head is model.embed_tokens.table


def test_fewer_than_two_tokens_is_refused_before_anything_runs(monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.argv", ["quantized", "--tokens", "1", "--folder", "/nonexistent/never-made"])
    with pytest.raises(SystemExit) as exit_info:
        quantized.main()
    assert exit_info.value.code == 2 and "--tokens=1: expected at least 2" in capsys.readouterr().err
