"""``Engine(prepack_weights=True)``: the model's float32 linear weights held in oneDNN's blocked layout
(``blocks.prepacked_linear``). Each request of a staggered continuous batch gets the tokens of ``generate`` on the
plain model alone and the log-probabilities of one forward pass of it (within float32 reordering), in every compile
mode and on every family the engine serves; the engine's layers are really prepacked (a tied head is not); and bad
values are refused before anything is changed.
"""

from __future__ import annotations

import copy

import pytest
import torch

from blocks import prepacked_linear
from blocks.prepacked_linear import PrepackedLinear, prepack_linears
from models import DecoderLM
from models.generation import compiled
from serving import Engine, cli, cli_options
from serving.aot_export import KINDS, export_step, rebuilt, tensor_signature
from serving.aot_steps import prepacked
from serving.startup import startup_line

from .test_cli_quantize import setup  # noqa: F401 - the fixture
from .test_engine import FAMILIES, MAX_TOKENS, alone, prompts, run_staggered, tiny_model
from .test_engine_aot import thin_model

ORDER = [3, 0, 1, 4]
ARRIVALS = {0: [3, 0], 2: [1], 5: [4]}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def pack_small_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny models' weights are below the size ``prepack_linears`` packs by default: pack them all."""
    monkeypatch.setattr(prepacked_linear, "MIN_ELEMENTS", 0)


def staggered(engine: Engine, ps: list[list[int]]) -> list:
    return run_staggered(engine, {step: [(ps[i], dict(max_tokens=MAX_TOKENS[i], logprobs=3)) for i in items]
                                  for step, items in ARRIVALS.items()})


def check_against_the_plain_model(plain: DecoderLM, outputs: list, ps: list[list[int]]) -> None:
    for i, out in zip(ORDER, outputs, strict=True):
        assert out.token_ids == alone(plain, ps[i], MAX_TOKENS[i]), i
        ids = torch.tensor([ps[i] + out.token_ids])
        with torch.no_grad():
            want = plain(ids).logits[0, len(ps[i]) - 1: -1].log_softmax(-1)
        chosen = want[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.logprobs]), chosen, rtol=0, atol=1e-4)


def prepacked_count(model: DecoderLM) -> int:
    return sum(isinstance(m, PrepackedLinear) for m in model.modules())


@pytest.mark.parametrize("preset", FAMILIES)
def test_every_family_gives_the_plain_models_tokens_and_log_probs(preset: str) -> None:
    plain = tiny_model(preset)
    model = copy.deepcopy(plain)
    ps = prompts()
    engine = Engine(model, block_size=4, max_num_batched_tokens=16, max_num_seqs=3, prepack_weights=True)
    assert engine.model is model and prepacked_count(model) >= 4 * model.config.n_layers
    assert engine.prepacked == [name for name, m in model.named_modules() if isinstance(m, PrepackedLinear)]
    check_against_the_plain_model(plain, staggered(engine, ps), ps)


@pytest.mark.parametrize("compile_mode", ["attention", True])
def test_compiled_steps_give_the_plain_models_tokens_and_log_probs(monkeypatch: pytest.MonkeyPatch,
                                                                   compile_mode: bool | str) -> None:
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    plain = tiny_model("qwen3-tiny")
    model = copy.deepcopy(plain)
    ps = prompts()
    engine = Engine(model, block_size=4, max_num_batched_tokens=16, max_num_seqs=3, prepack_weights=True,
                    compile=compile_mode)
    check_against_the_plain_model(plain, staggered(engine, ps), ps)
    # The head is tied to the embeddings: it keeps its plain rows.
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(prepack_weights="yes"), ValueError, "prepack_weights must be True or False, got 'yes'"),
    (dict(prepack_weights=1), ValueError, "prepack_weights must be True or False, got 1"),
    (dict(prepack_weights=True, max_loras=1), ValueError, "cannot be combined with adapters"),
])
def test_bad_values_are_refused_before_the_model_changes(kwargs: dict, error: type, match: str) -> None:
    model = tiny_model("tiny")
    with pytest.raises(error, match=match):
        Engine(model, **kwargs)
    assert prepacked_count(model) == 0


def test_a_build_without_onednn_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepacked_linear, "prepacking_available", lambda: False)
    model = tiny_model("tiny")
    with pytest.raises(RuntimeError, match="oneDNN"):
        Engine(model, prepack_weights=True)
    assert prepacked_count(model) == 0


def test_zoo_serve_prepacks_when_told_and_never_with_adapters(setup, monkeypatch) -> None:  # noqa: F811
    import uvicorn

    from serving import openai_api

    folder = setup[2] / "float"  # a tiny model saved with its tokenizer
    seen: dict = {}
    monkeypatch.setattr(openai_api, "create_app", lambda model, *args, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    for flags, want in [([], cli_options.PREPACK_DEFAULT), (["--no-prepack-weights"], False),
                        (["--prepack-weights"], True), (["--max-loras", "2"], False),
                        (["--lora", "a=./a"], False)]:
        seen.clear()
        cli.main(["serve", str(folder), *flags])
        assert seen["prepack_weights"] is want, flags
    seen.clear()
    with pytest.raises(SystemExit, match="--prepack-weights cannot be combined with --lora or --max-loras"):
        cli.main(["serve", str(folder), "--prepack-weights", "--max-loras", "2"])
    assert not seen


def test_the_startup_line_counts_the_weights_to_be_prepacked(monkeypatch: pytest.MonkeyPatch) -> None:
    args = cli.parser().parse_args(["serve", "some-model"])
    limits = dict(max_num_seqs=2, num_blocks=8, block_size=4, kv_cache_bytes=None, max_model_len=64, compile=False)
    model = tiny_model("qwen3-tiny")  # its head is tied to the embeddings: not counted
    linears = sum(type(m) is torch.nn.Linear for m in model.modules()) - 1
    assert model.lm_head.weight is model.embed_tokens.weight and linears == 7 * model.config.n_layers
    with torch.device("meta"):  # zoo serve reads the config only, the engine process loads the weights
        meta = DecoderLM(model.config)
    for m in (model, meta):
        assert startup_line("m", m, args, {**limits, "prepack_weights": True}).endswith(
            f"compile off, {linears} linear weights prepacked")
        assert startup_line("m", m, args, {**limits, "prepack_weights": False}).endswith("compile off")
    on_gpu = cli.parser().parse_args(["serve", "some-model", "--device", "cuda"])
    assert startup_line("m", meta, on_gpu, {**limits, "prepack_weights": True}).endswith("compile off")
    monkeypatch.setattr(prepacked_linear, "MIN_ELEMENTS", 2**20)  # every weight smaller: nothing to say
    assert startup_line("m", model, args, {**limits, "prepack_weights": True}).endswith("compile off")
    assert Engine(model, prepack_weights=True).prepacked == [] and prepacked_count(model) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_the_compile_process_prepacks_the_engines_layers_and_exports_the_op(kind: str) -> None:
    """What the compile process does with a prepacked engine's spec (``serving.aot_export.compile_packages``), up to
    AOTInductor (the whole compile and run: ``tests/serving/test_engine_aot_prepacked.py``, marked slow)."""
    model = thin_model()
    Engine(model, prepack_weights=True, block_size=4, num_blocks=8)
    names = prepacked(model)
    assert len(names) == 7 * model.config.n_layers  # q, k, v, o, gate, up, down; the head is tied
    child = rebuilt(type(model), model.config, torch.float32)
    assert prepack_linears(child, names=names) == names
    assert tensor_signature(child) == tensor_signature(model)  # else the child exits NOT_EXPORTABLE
    program = export_step(child, 4, kind)
    calls = [n for n in program.graph.nodes if n.target is torch.ops.zoo.prepacked_linear.default]
    assert len(calls) == len(names)
    assert {f"model.{name}.handle" for name in names} <= set(program.graph_signature.inputs_to_buffers.values())
