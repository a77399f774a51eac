"""``zoo generate / chat / serve --quantize SCHEME`` quantizes a float checkpoint after loading, and is refused with
one line for a checkpoint that is already quantized; ``--dequantize`` loads such a checkpoint as float32. The
references are the models quantized or dequantized in the test, run by ``generate``."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch

from blocks.quantized import Int8Linear, QuantizedLinear, packable_schemes
from models import DecoderLM
from serving import cli
from serving.engine_process import ModelSource
from tokenization import Tokenizer, train_byte_level_bpe

TEMPLATE = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
PROMPT = "the quick brown"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[DecoderLM, Tokenizer, Path]:
    """A tiny float model and its tokenizer, saved as a float checkpoint ``float`` and quantized as ``int8``."""
    corpus = ["the quick brown fox jumps over the lazy dog", "hello there, how are you today?"] * 4
    tok = train_byte_level_bpe(corpus, vocab_size=300, min_frequency=1)
    tok = Tokenizer(tok.backend, chat_template=TEMPLATE)
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", vocab_size=300, dropout=0.0).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # outputs that vary, and that int8 rounding changes
    folder = tmp_path_factory.mktemp("cli-quantize")
    model.save_pretrained(folder / "float", tokenizer=tok)
    copy.deepcopy(model).quantize("int8").save_pretrained(folder / "int8", tokenizer=tok)
    return model, tok, folder


def completion(model: DecoderLM, tok: Tokenizer, ids: list[int], n: int = 6) -> str:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, eos_token_id=model.config.eos_token_id)
    return tok.decode(out[0, len(ids):].tolist())


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> list[DecoderLM]:
    """The models the commands build their engines with (int8 rounding rarely changes a greedy token: the text alone
    would not tell a quantized run from a float one)."""
    from serving import engine

    built: list[DecoderLM] = []
    real = engine.Engine
    monkeypatch.setattr(engine, "Engine", lambda model, *args, **kwargs: built.append(model) or real(model, *args,
                                                                                                     **kwargs))
    return built


def generate(*argv: str) -> str:
    out = io.StringIO()
    cli.generate(cli.parser().parse_args(["generate", *argv, "--max-tokens", "6"]), stdout=out)
    return out.getvalue()


def int8_layers(model: DecoderLM) -> int:
    return sum(isinstance(m, Int8Linear) for m in model.modules())


def test_generate_quantizes_a_float_checkpoint_and_runs_a_quantized_one(setup, engines: list[DecoderLM]) -> None:
    model, tok, folder = setup
    want = completion(copy.deepcopy(model).quantize("int8"), tok, tok.encode(PROMPT))
    assert generate(str(folder / "float"), PROMPT, "--quantize", "int8") == want + "\n"
    assert generate(str(folder / "int8"), PROMPT) == want + "\n"  # saved quantized, loaded quantized
    assert generate(str(folder / "float"), PROMPT) == completion(model, tok, tok.encode(PROMPT)) + "\n"
    assert [int8_layers(m) for m in engines] == [13, 13, 0]  # 6 per layer and the head


def test_quantize_is_refused_for_a_quantized_checkpoint_and_dequantize_loads_float32(
    setup, engines: list[DecoderLM]
) -> None:
    model, tok, folder = setup
    for command in (["generate", str(folder / "int8"), PROMPT], ["chat", str(folder / "int8")]):
        with pytest.raises(SystemExit) as refused:
            cli.main([*command, "--quantize", "int8"])
        message = str(refused.value.code)
        assert message.startswith(f"zoo: error: {folder / 'int8'} is already quantized (13 layers as 'int8')")
        assert "--dequantize" in message and "\n" not in message
    dequantized = copy.deepcopy(model).quantize("int8").dequantize()
    want = completion(dequantized, tok, tok.encode(PROMPT))
    assert generate(str(folder / "int8"), PROMPT, "--dequantize") == want + "\n"
    # A float checkpoint loads as it is.
    assert generate(str(folder / "float"), PROMPT, "--dequantize") == completion(model, tok, tok.encode(PROMPT)) + "\n"
    assert len(engines) == 2 and not any(isinstance(m, QuantizedLinear) for e in engines for m in e.modules())
    assert {p.dtype for p in engines[0].parameters()} == {torch.float32}


def test_chat_quantizes_the_model_it_answers_with(setup, engines: list[DecoderLM]) -> None:
    model, tok, folder = setup
    out = io.StringIO()
    cli.chat(cli.parser().parse_args(["chat", str(folder / "float"), "--max-tokens", "6", "--quantize", "int8",
                                      "--temp", "0"]), stdin=io.StringIO("hello there\n"), stdout=out)
    ids = tok.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True)
    answer = out.getvalue().split("\n")[0].removesuffix(" [cut at the 6-token limit; raise it with --max-tokens]")
    assert answer == "> " + completion(copy.deepcopy(model).quantize("int8"), tok, ids)
    assert [int8_layers(m) for m in engines] == [13]


@pytest.mark.parametrize("command", [["serve", "m"], ["chat", "m"], ["generate", "m", "p"]])
def test_unknown_schemes_and_both_flags_are_usage_errors(command: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as bad:
        cli.parser().parse_args([*command, "--quantize", "int3"])
    choices = ", ".join(repr(s) for s in packable_schemes())  # the K-quants are only read from files
    assert bad.value.code == 2
    assert f"argument --quantize: invalid choice: 'int3' (choose from {choices})" in capsys.readouterr().err
    with pytest.raises(SystemExit) as both:
        cli.parser().parse_args([*command, "--quantize", "int8", "--dequantize"])
    assert both.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert cli.parser().parse_args([*command, "--quantize", "int8"]).quantize == "int8"


def test_serve_hands_the_request_to_the_engine_process_or_quantizes_in_process(setup, monkeypatch) -> None:
    import uvicorn

    from serving import openai_api

    _, _, folder = setup
    seen: dict = {}
    monkeypatch.setattr(openai_api, "create_app", lambda model, *args, **kwargs: seen.update(kwargs, model=model))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    cli.main(["serve", str(folder / "float"), "--quantize", "int8"])
    source = seen["engine_process"]
    assert source == ModelSource(path=str(folder / "float"), quantize="int8")
    assert any(isinstance(m, Int8Linear) for m in source.build().modules())  # what the engine process runs
    cli.main(["serve", str(folder / "float"), "--quantize", "int8", "--no-engine-process"])
    assert seen["engine_process"] is False and any(isinstance(m, Int8Linear) for m in seen["model"].modules())
    seen.clear()
    with pytest.raises(SystemExit, match="is already quantized"):  # found in the server process, on the meta device
        cli.main(["serve", str(folder / "int8"), "--quantize", "int8"])
    assert not seen
    cli.main(["serve", str(folder / "int8"), "--dequantize"])
    built = seen["engine_process"].build()
    assert not any(isinstance(m, QuantizedLinear) for m in built.modules())
    assert {p.dtype for p in built.parameters()} == {torch.float32}


def test_model_source_checks_its_quantization_request() -> None:
    with pytest.raises(ValueError, match=r"unknown quantization scheme 'int3'; expected one of \["):
        ModelSource(path="m", quantize="int3")
    with pytest.raises(ValueError, match="quantize and dequantize exclude each other"):
        ModelSource(path="m", quantize="int8", dequantize=True)
    with pytest.raises(ValueError, match="dequantize must be True or False, got 'yes'"):
        ModelSource(path="m", dequantize="yes")
