"""``benchmarks.decode_products``: its shapes are the real models' products, a quick run times BLAS, oneDNN and
prepacked layers on the same products (they agree, which the script checks before timing), and bad flags are refused."""

from __future__ import annotations

import pytest
import torch

from benchmarks import decode_products
from benchmarks.thin import SHAPES as REAL
from models import DecoderLM, DecoderLMConfig


@pytest.mark.parametrize(("shape", "real"), [("smollm2", "smollm2-135m"), ("qwen3", "qwen3-0.6b")])
def test_shapes_are_the_real_models_products(shape: str, real: str) -> None:
    with torch.device("meta"):
        model = DecoderLM(DecoderLMConfig.from_dict({**REAL[real], "max_len": 64}))
    linears = [m for m in model.layers[0].modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(decode_products.SHAPES[shape]["layer"]) == sorted((m.in_features, m.out_features) for m in linears)
    assert decode_products.SHAPES[shape]["head"] == (model.lm_head.in_features, model.lm_head.out_features)


def test_a_quick_run_reports_both_libraries(capsys: pytest.CaptureFixture[str]) -> None:
    report = decode_products.main(["--quick"])
    assert [(r["shape"], r["rows"]) for r in report] == [("tiny", 2), ("tiny", 4)]
    weights = sum(i * o for i, o in decode_products.SHAPES["tiny"]["layer"]) * 2 + 64 * 512
    assert [r["flop"] for r in report] == [2.0 * 2 * weights, 2.0 * 4 * weights]
    assert all(r["BLAS"] > 0 and r["oneDNN"] > 0 and r["prepacked"] > 0 for r in report)
    out = capsys.readouterr().out
    assert "oneDNN vs BLAS" in out and "prepacked vs oneDNN" in out


@pytest.mark.parametrize("flag", [["--rows", "2", "0"], ["--layers", "0"], ["--rounds", "-1"], ["--threads", "0"]])
def test_bad_flags_are_refused(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        decode_products.main(flag)
    assert flag[0] in capsys.readouterr().err
