"""Per-request LoRA adapters in the engine's continuous batch (``serving.lora_registry``, ``blocks.multi_lora``).

The reference for every request is the request alone on the model with its adapter MERGED into the weights
(``W + scale · B A``: the zoo's ``merge_adapter``, and ``peft``'s own ``merge_and_unload`` for an adapter that
``peft`` saved), decoded greedily by full forward passes: tokens and every step's log-probabilities must match.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import peft
import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from models import DecoderLM
from models.convert import save_transformers
from models.generation import compiled
from serving import Engine

VOCAB = 50
TINY = dict(vocab_size=VOCAB, d_model=32, n_heads=2, n_kv_heads=1, d_ff=48, n_layers=2, max_len=64, dropout=0.0,
            attention_dropout=0.0, eos_token_id=None)
# name -> (rank, alpha, zoo targets): different ranks and targets
ZOO_ADAPTERS = {"r2": (2, 4, ["q_proj", "v_proj"]), "r4": (4, 3, "all-linear"), "r8": (8, 16, ["o_proj", "down_proj"])}
MAX_TOKENS = 5


def base_model() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM.from_preset("llama-tiny", **TINY).eval()


def randomize(model: DecoderLM, seed: int) -> None:
    """Non-trivial adapters: B drawn at random (a fresh LoRA's B is zero and would change nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three adapters saved by the zoo and one (rank 16, rslora, a rank pattern) saved by ``peft`` itself."""
    root = tmp_path_factory.mktemp("loras")
    folders = {}
    for i, (name, (r, alpha, targets)) in enumerate(ZOO_ADAPTERS.items()):
        model = base_model()
        model.add_adapter(r=r, alpha=alpha, target_modules=targets)
        randomize(model, i)
        folders[name] = model.save_adapter(root / name)
    save_transformers(base_model(), root / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
    config = peft.LoraConfig(r=16, lora_alpha=8, use_rslora=True, rank_pattern={"k_proj": 6},
                             target_modules=["k_proj", "gate_proj", "up_proj"], init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuned = peft.get_peft_model(hf, config).eval()
    randomize(tuned, 7)
    tuned.save_pretrained(root / "peft16")
    folders["peft16"] = root / "peft16"
    tuned.merge_and_unload().save_pretrained(root / "peft16-merged")  # peft's own merge: the reference
    return folders


def merged(folders: dict[str, Path], name: str | None) -> torch.nn.Module:
    """The base model with adapter ``name`` merged into its weights (``None``: the base model)."""
    if name == "peft16":
        return transformers.AutoModelForCausalLM.from_pretrained(folders["peft16"].parent / "peft16-merged").eval()
    model = base_model()
    if name is not None:
        model.load_adapter(folders[name])
        model.merge_adapter()
    return model


def reference(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's log-probabilities, by full forward passes."""
    ids, steps = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            steps.append(logits.log_softmax(-1))
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], steps


def prompts(count: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def check(folders, outputs, batch) -> None:  # noqa: ANN001
    for out, (prompt, name) in zip(outputs, batch, strict=True):
        tokens, steps = reference(merged(folders, name), prompt, MAX_TOKENS)
        assert out.token_ids == tokens, name
        for entry, logprobs in zip(out.logprobs, steps, strict=True):
            got = torch.tensor([entry.top[t] for t in range(VOCAB)])
            torch.testing.assert_close(got, logprobs, atol=2e-5, rtol=0)


def mixed_batch() -> list[tuple[list[int], str | None]]:
    names = [*ZOO_ADAPTERS, "peft16", None, None]
    return list(zip(prompts(2 * len(names)), names * 2, strict=True))


def generate(engine: Engine, batch: list[tuple[list[int], str | None]]) -> list:
    return engine.generate([p for p, _ in batch], max_tokens=MAX_TOKENS, logprobs=VOCAB,
                           adapter=[a for _, a in batch])


def test_mixed_adapters_in_one_batch_equal_each_request_alone_on_its_merged_model(adapters) -> None:  # noqa: ANN001
    engine = Engine(base_model(), block_size=4, max_num_seqs=16, loras=adapters)
    assert engine.lora_names() == list(adapters) and engine.loras.max_rank == 16
    batch = mixed_batch()
    steps = []
    route = engine.loras.route
    engine.loras.route = lambda scheduled: steps.append({s.spec.adapter for s, _ in scheduled}) or route(scheduled)
    check(adapters, generate(engine, batch), batch)
    assert max(len(s) for s in steps) == 5  # four adapters and the base model shared steps


def test_a_prefix_cached_under_one_adapter_is_not_reused_by_another(adapters) -> None:  # noqa: ANN001
    engine = Engine(base_model(), block_size=4, max_num_seqs=4, loras=adapters)
    prompt = prompts(1, seed=9)[0] * 3  # several full blocks
    batch = [(prompt, "r2")]
    check(adapters, generate(engine, batch), batch)
    generate(engine, batch)
    assert engine.scheduler.prefix_hits > 0  # the same adapter again: its blocks are reused
    # (The prefix cache lives within the pools, so the blocks of the requests below may evict r2's: r2's are
    # looked up while cached, right after its own run.)
    for name in ("r4", None, "peft16"):
        hits = engine.scheduler.prefix_hits
        check(adapters, generate(engine, [(prompt, name)]), [(prompt, name)])
        assert engine.scheduler.prefix_hits == hits  # another adapter: nothing reused


def test_loading_and_unloading_while_requests_run_leaves_their_outputs_unchanged(adapters) -> None:  # noqa: ANN001
    """Two slots for three adapters (least recently used evicted); an adapter removed mid-stream finishes its
    requests; new requests cannot name it."""
    engine = Engine(base_model(), block_size=4, max_num_seqs=8, max_loras=2, loras={"r2": adapters["r2"]})
    batch = list(zip(prompts(4, seed=5), ["r2", None, "r4", "r8"], strict=True))
    ids = [engine.add_request(batch[0][0], max_tokens=MAX_TOKENS, logprobs=VOCAB, adapter="r2"),
           engine.add_request(batch[1][0], max_tokens=MAX_TOKENS, logprobs=VOCAB)]
    engine.step()
    engine.add_lora("r4", adapters["r4"])
    ids.append(engine.add_request(batch[2][0], max_tokens=MAX_TOKENS, logprobs=VOCAB, adapter="r4"))
    engine.step()
    engine.remove_lora("r2")  # in use: stays until its request ends
    with pytest.raises(ValueError, match="'r2' is not loaded"):
        engine.add_request([1, 2], adapter="r2")
    engine.add_lora("r8", adapters["r8"])  # a third adapter for two slots: waits for r2's slot
    ids.append(engine.add_request(batch[3][0], max_tokens=MAX_TOKENS, logprobs=VOCAB, adapter="r8"))
    while engine.has_unfinished():
        engine.step()
    check(adapters, [engine.pop_output(i) for i in ids], batch)
    assert engine.lora_names() == ["r4", "r8"]


@pytest.mark.parametrize("bad, match", [
    ("r2", "already loaded"), ("bad name!", "lora_name must be"),
])
def test_bad_adapter_names_are_refused(adapters, bad: str, match: str) -> None:  # noqa: ANN001
    engine = Engine(base_model(), block_size=4, loras={"r2": adapters["r2"]})
    with pytest.raises(ValueError, match=match):
        engine.add_lora(bad, adapters["r4"])


def test_adapters_that_do_not_fit_are_refused_naming_what(adapters, tmp_path: Path) -> None:  # noqa: ANN001
    engine = Engine(base_model(), block_size=4, max_loras=1, max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8 .* above max_lora_rank=4"):
        engine.add_lora("big", adapters["r8"])
    other = DecoderLM.from_preset("llama-tiny", **{**TINY, "d_model": 16}).eval()
    other.add_adapter(r=2, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="shape"):
        engine.add_lora("other", other.save_adapter(tmp_path / "other"))
    head = base_model()
    head.add_adapter(r=2, target_modules=["lm_head"])
    with pytest.raises(ValueError, match="cannot batch adapters on"):
        engine.add_lora("head", head.save_adapter(tmp_path / "head"))
    assert engine.lora_names() == []
    with pytest.raises(ValueError, match="serves no adapters"):
        Engine(base_model(), block_size=4).add_lora("x", adapters["r2"])


def test_compiled_steps_match_and_loading_an_adapter_does_not_recompile(adapters,  # noqa: ANN001
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "BACKEND", "eager")  # dynamo's graphs and guards, without a compiler's time
    torch._dynamo.reset()
    counters.clear()
    engine = Engine(base_model(), block_size=4, max_num_seqs=16, max_loras=4, compile=True,
                    loras={k: adapters[k] for k in ("r2", "r4")})
    warm = mixed_batch()[:2]  # compiles the several-row graph, then the one-row graph (r4 ends first)
    engine.generate([p for p, _ in warm], max_tokens=[4, 2], adapter=[a for _, a in warm])
    graphs = counters["stats"]["unique_graphs"]
    engine.add_lora("r8", adapters["r8"])
    engine.add_lora("peft16", adapters["peft16"])
    batch = mixed_batch()
    check(adapters, generate(engine, batch), batch)
    assert counters["stats"]["unique_graphs"] == graphs  # new adapters in new slots: the same graphs


def test_adapters_sit_beside_a_quantized_base(adapters) -> None:  # noqa: ANN001
    """Slots beside int8-packed weights (float32 products, as QLoRA): each row equals the quantized model running
    that adapter alone (``AdaptedQuantizedLinear``), and the base rows equal the quantized model."""
    engine = Engine(base_model().quantize("int8"), block_size=4, max_num_seqs=8, loras=adapters)
    batch = mixed_batch()[:6]
    outputs = generate(engine, batch)
    for out, (prompt, name) in zip(outputs, batch, strict=True):
        model = base_model().quantize("int8")
        if name is not None:
            model.load_adapter(adapters[name])
        assert out.token_ids == reference(model, prompt, MAX_TOKENS)[0], name
