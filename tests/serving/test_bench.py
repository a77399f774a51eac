"""``zoo bench MODEL``: the llama-bench-like table of an engine on this machine (figures are not checked, only what
they are made of: the weights' and pools' sizes, the tests named after the workload, bad sizes refused)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cli.main import main
from models import DecoderLM
from serving import Engine, bench
from serving.bench import measure
from tokenization import train_byte_level_bpe


@pytest.fixture(scope="module")
def model() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM.from_preset("llama-tiny", vocab_size=300, eos_token_id=None).eval()


def test_measure_reports_throughput_latency_and_memory(model: DecoderLM) -> None:
    engine = Engine(model, block_size=4, max_num_seqs=4)
    rows = {name: (value, unit) for name, value, unit in measure(engine, prompt_len=9, gen_len=5, concurrency=3,
                                                                 repetitions=1).rows}
    assert list(rows) == ["pp9", "tg5", "tg5 x3", "ttft alone", "ttft x3", "first use", "weights", "kv pools",
                          "resident", "resident peak"]
    assert all(value > 0 for value, _ in rows.values())
    weights = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    assert rows["weights"] == (weights / 2**20, "MiB")
    # 3 requests of 9 + 5 positions at most in flight: 4 blocks of 4 each, the pool grown (doubling) past 12.
    assert rows["kv pools"][0] * 2**20 == engine.runner.nbytes >= 12 * engine.runner.block_nbytes()
    assert rows["resident peak"][0] >= rows["resident"][0]
    with pytest.raises(ValueError, match="gen_len must be an integer >= 2, got 1"):
        measure(engine, gen_len=1)
    with pytest.raises(ValueError, match="prompt_len \\+ gen_len = 300 exceeds the engine's context of 256"):
        measure(engine, prompt_len=200, gen_len=100)


def test_zoo_bench_prints_one_table(model: DecoderLM, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tok = train_byte_level_bpe(["the quick brown fox jumps over the lazy dog"] * 4, vocab_size=300, min_frequency=1)
    model.save_pretrained(tmp_path, tokenizer=tok)
    main(["bench", str(tmp_path), "--prompt-len", "6", "--gen-len", "3", "--concurrency", "2", "--repetitions", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| model | params | threads | compile | weights | test | value | unit |"
    assert [line.split(" | ")[5] for line in lines[2:5]] == ["pp6", "tg3", "tg3 x2"]
    assert all(line.split(" | ")[3] == "none" for line in lines[2:])
    assert all(line.split(" | ")[4] == "plain" for line in lines[2:])  # zoo serve's default


def test_zoo_bench_takes_the_cache_dtype(model: DecoderLM, tmp_path: Path, capsys: pytest.CaptureFixture,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    tok = train_byte_level_bpe(["the quick brown fox jumps over the lazy dog"] * 4, vocab_size=300, min_frequency=1)
    model.save_pretrained(tmp_path, tokenizer=tok)
    engines = []

    def kept(*args: object, **kwargs: object) -> Engine:
        engines.append(Engine(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(bench, "Engine", kept)
    main(["bench", str(tmp_path), "--prompt-len", "6", "--gen-len", "3", "--concurrency", "2", "--repetitions", "1",
          "--kv-cache-dtype", "float16"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| model | params | threads | compile | kv cache | weights | test | value | unit |"
    assert all(line.split(" | ")[4] == "float16" for line in lines[2:])
    assert {cache.self_attn.k.dtype for cache in engines[0].runner.caches} == {torch.float16}
    with pytest.raises(SystemExit):
        main(["bench", str(tmp_path), "--kv-cache-dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_zoo_bench_counts_prepacked_weights_and_takes_the_flag(model: DecoderLM, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from blocks import prepacked_linear
    from blocks.prepacked_linear import PrepackedLinear

    monkeypatch.setattr(prepacked_linear, "MIN_ELEMENTS", 0)  # the tiny model's weights are all small
    tok = train_byte_level_bpe(["the quick brown fox jumps over the lazy dog"] * 4, vocab_size=300, min_frequency=1)
    model.save_pretrained(tmp_path, tokenizer=tok)
    weights = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    engines = []

    def kept(*args: object, **kwargs: object) -> Engine:
        engines.append(Engine(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(bench, "Engine", kept)
    linears = sum(type(m) is torch.nn.Linear and m.weight is not model.embed_tokens.weight for m in model.modules())
    for flag, layout in [("--prepack-weights", f"{linears} prepacked"), ("--no-prepack-weights", "plain")]:
        main(["bench", str(tmp_path), "--prompt-len", "6", "--gen-len", "3", "--concurrency", "2", "--repetitions",
              "1", flag])
        lines = capsys.readouterr().out.splitlines()
        assert all(line.split(" | ")[4] == layout for line in lines[2:]), flag
        row = next(line for line in lines[2:] if line.split(" | ")[5] == "weights")
        handles = 8 * sum(isinstance(m, PrepackedLinear) for m in engines[-1].model.modules())  # int64 buffers
        assert float(row.split(" | ")[6]) == pytest.approx((weights + handles) / 2**20, abs=0.01)
    assert any(isinstance(m, PrepackedLinear) for m in engines[0].model.modules())
    assert not any(isinstance(m, PrepackedLinear) for m in engines[1].model.modules())
