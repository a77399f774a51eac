"""``benchmarks.thin``: the shapes are the issue's, the floor counts a tied head once, bad flags are refused.

(`python -m benchmarks.compare --quick` runs `benchmarks.thin --quick` as its row 7, in test_benchmark_compare.)
"""

from __future__ import annotations

import pytest

from benchmarks import thin
from models import DecoderLMConfig


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ("smollm2-135m", dict(n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, d_head=64, d_ff=1536,
                              vocab_size=49152, tie_embeddings=True, ffn="swiglu", norm="rmsnorm")),
        ("qwen3-0.6b", dict(n_layers=28, d_model=1024, n_heads=16, n_kv_heads=8, d_head=128, d_ff=3072,
                            vocab_size=151936, tie_embeddings=True, ffn="swiglu", norm="rmsnorm")),
    ],
)
def test_shapes_are_the_real_models(shape: str, expected: dict) -> None:
    config = DecoderLMConfig.from_dict({**thin.SHAPES[shape], "max_len": 1024})
    assert {k: getattr(config, k) for k in expected} == expected
    assert config.options.get("attention", {}).get("qk_norm") == ("rmsnorm" if shape == "qwen3-0.6b" else None)


def test_floor_bytes_count_a_tied_head_once() -> None:
    model = thin.build("qwen3-0.6b", layers=2, quick=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    distinct = {p.data_ptr(): p.numel() * 4 for p in model.state_dict().values() if p.is_floating_point()}
    assert thin.weight_bytes(model) == sum(distinct.values())


@pytest.mark.parametrize("flag", [["--reps", "0"], ["--new-tokens", "1"], ["--batches", "1", "0"]])
def test_bad_flags_are_refused(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        thin.main(flag)
    assert flag[0] in capsys.readouterr().err
