"""Compiled static-shape decoding: one graph for every step, prompt length of a bucket and call; eager tokens."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import models.generation.compiled as compiled
from models import DecoderLM, DecoderLMConfig
from models.generation import steps
from models.generation.requests import LMRequest, lm_request
from tests.models.test_kv_cache import build


def decoder(**overrides: object) -> DecoderLM:
    config = dict(vocab_size=64, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=128, dropout=0.0)
    return build(DecoderLM, DecoderLMConfig(**{**config, **overrides}), 0)


@pytest.mark.parametrize("positional", ["learned", "rotary"])
def test_one_graph_for_three_prompt_lengths_and_repeated_calls(graph_backend: None, positional: str) -> None:
    model = decoder(positional=positional)
    g = torch.Generator().manual_seed(0)
    for call, length in enumerate([5, 9, 14, 9]):  # one bucket (64); the last call repeats a length
        prompt = torch.randint(4, 64, (2, length), generator=g)
        out = model.generate(prompt, max_new_tokens=12, eos_token_id=None, compile=True)
        assert torch.equal(out, model.generate(prompt, max_new_tokens=12, eos_token_id=None))
        if call == 0:
            graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["total"]
            assert graphs == 1  # the step compiled once, at the first call
    assert counters["stats"]["unique_graphs"] == graphs and counters["frames"]["total"] == frames


def test_left_padded_batches_sampling_and_stream_match_eager(graph_backend: None) -> None:
    model = decoder(positional="rotary")
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    prompt = torch.randint(4, 64, (2, 5)).masked_fill(~mask, 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=9, eos_token_id=7)
    eager = model.generate(prompt, **kwargs)
    assert torch.equal(model.generate(prompt, compile=True, **kwargs), eager)
    assert torch.equal(torch.stack(list(model.stream(prompt, compile=True, **kwargs)), 1), eager[:, 5:])
    sampled = dict(do_sample=True, top_k=8, repetition_penalty=1.2, max_new_tokens=9, eos_token_id=None)
    a = model.generate(prompt[1:], generator=torch.Generator().manual_seed(1), compile=True, **sampled)
    b = model.generate(prompt[1:], generator=torch.Generator().manual_seed(1), **sampled)
    assert torch.equal(a, b)


@pytest.mark.slow
def test_inductor_tokens_equal_eager() -> None:
    model = decoder()
    prompt = torch.randint(4, 64, (1, 7))
    eager = model.generate(prompt, max_new_tokens=10, eos_token_id=None)
    assert torch.equal(model.generate(prompt, max_new_tokens=10, eos_token_id=None, compile=True), eager)


def test_unsupported_combinations_raise() -> None:
    model, prompt = decoder(), torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="attention backends, the model uses 'flex'"):
        model.generate(prompt, compile=True, draft_model=decoder(attention_backend="flex"))
    with pytest.raises(ValueError, match="compile must be True or False, got 'yes'"):
        model.generate(prompt, compile="yes")
    with pytest.raises(ValueError, match="attention backends, the model uses 'flex'"):
        decoder(attention_backend="flex").generate(prompt, compile=True)


def test_buckets() -> None:
    assert [compiled.bucket_length(n, None) for n in (1, 64, 65, 200)] == [64, 64, 128, 256]
    assert compiled.bucket_length(100, 110) == 110  # learned positions end before the bucket would


def test_compiled_draft_in_generate_gives_plain_greedy(graph_backend: None) -> None:
    target, draft = decoder(), decoder(n_layers=1)
    prompt = torch.tensor([[5, 6, 7, 8]])
    kwargs = dict(max_new_tokens=10, eos_token_id=None)
    fast = target.generate(prompt, draft_model=draft, num_draft_tokens=3, compile=True, **kwargs)
    assert torch.equal(fast, target.generate(prompt, **kwargs))
    assert counters["stats"]["unique_graphs"] == 1  # the draft's step


def test_two_models_alternating_keep_their_own_graphs(graph_backend: None) -> None:
    # Steps after the first skip dynamo's guard checks; a second model (same shapes, other weights, other
    # positions) must still get its own graph and its own tokens.
    first, second = decoder(), build(DecoderLM, DecoderLMConfig(
        vocab_size=64, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=128, dropout=0.0, positional="rotary"), 1)
    prompt = torch.randint(4, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    for model in (first, second, first, second):
        kwargs = dict(max_new_tokens=10, eos_token_id=None)
        assert torch.equal(model.generate(prompt, compile=True, **kwargs), model.generate(prompt, **kwargs))



def test_interleaved_compiled_streams_keep_their_own_buffers(graph_backend: None) -> None:
    # Two compiled streams of one model and bucket open at once, and a compiled generate of the same shapes run
    # between their tokens: each must decode in buffers of its own (one shared set gave wrong tokens), with no
    # new graph for the second set.
    model = decoder(positional="rotary")
    a, b = torch.tensor([[5, 6, 7, 8]]), torch.randint(4, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=10, eos_token_id=None)
    expected_a, expected_b = model.generate(a, **kwargs)[0, 4:], model.generate(b, **kwargs)[0, 12:]
    first, second = model.stream(a, compile=True, **kwargs), model.stream(b, compile=True, **kwargs)
    got_a, got_b = [], []
    for i in range(10):
        got_a.append(next(first))
        got_b.append(next(second))
        if i == 4:
            assert torch.equal(model.generate(b, compile=True, **kwargs)[0, 12:], expected_b)
    assert torch.equal(torch.cat(got_a), expected_a) and torch.equal(torch.cat(got_b), expected_b)
    assert counters["stats"]["unique_graphs"] == 1
    del first, second
    pool = next(iter(compiled._BUFFERS[model].values()))
    assert len(pool) == 3 and all(kept.free() for kept in pool)


def test_frozen_cpu_step_batches_and_follows_weight_changes() -> None:
    # Inductor on CPU freezes a float model's weights into the graph (packed GEMMs for the batch's rows); the
    # step must give eager's tokens for a left-padded batch, and eager's tokens again after the weights change
    # in place (a stale frozen graph would keep the old weights' tokens).
    torch.manual_seed(0)
    model = decoder(positional="rotary")
    assert compiled.freezes_weights(model, torch.device("cpu"))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    prompt = torch.randint(4, 64, (3, 5), generator=torch.Generator().manual_seed(2)).masked_fill(~mask, 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    before = model.generate(prompt, **kwargs)
    assert torch.equal(model.generate(prompt, compile=True, **kwargs), before)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    after = model.generate(prompt, **kwargs)
    assert not torch.equal(after, before)
    assert torch.equal(model.generate(prompt, compile=True, **kwargs), after)
    # load_state_dict copies in place too: the next call compiles again (not run here: ~7 s of inductor).
    cpu = torch.device("cpu")
    step = compiled.compile_step(compiled.next_token_logits, model, cpu)
    assert compiled.compile_step(compiled.next_token_logits, model, cpu) is step
    model.load_state_dict(old)
    assert compiled.compile_step(compiled.next_token_logits, model, cpu) is not step


def test_int8_models_are_not_frozen() -> None:
    # Freezing would fold the int8 -> float conversion into a float constant: the step would read 4-byte weights.
    model = decoder()
    assert compiled.freezes_weights(model, torch.device("cpu"))
    assert not compiled.freezes_weights(model.quantize("int8"), torch.device("cpu"))
    assert not compiled.freezes_weights(decoder(), torch.device("meta"))


def test_compiled_steps_are_freed_with_their_model(graph_backend: None) -> None:
    import gc
    import weakref

    model = decoder()
    model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, eos_token_id=None, compile=True)
    assert len(compiled._COMPILED) >= 1
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


@pytest.mark.gpu
def test_cuda_graphs_tokens_equal_eager_across_calls_and_lengths() -> None:
    # On CUDA the step runs under CUDA graphs (inductor, mode="reduce-overhead"): fixed buffer addresses, outputs
    # overwritten by the next replay. Tokens must equal the eager path, for several prompt lengths and calls.
    torch._dynamo.reset()
    counters.clear()
    model = decoder(positional="rotary").cuda()
    g = torch.Generator().manual_seed(0)
    for length in (5, 9, 14, 9):
        prompt = torch.randint(4, 64, (2, length), generator=g).cuda()
        kwargs = dict(max_new_tokens=12, eos_token_id=None)
        assert torch.equal(model.generate(prompt, compile=True, **kwargs), model.generate(prompt, **kwargs))
    assert counters["stats"]["unique_graphs"] == 1


# ================================================================================= growing buckets, logit values
def spread(model: DecoderLM) -> DecoderLM:
    """Wider logits than the initialisation gives: steps differ in value, and tokens do not repeat."""
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def test_compiled_logits_equal_an_uncached_forward_at_every_step_across_buckets(
    graph_backend: None, bucket_sizes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # One new token of room at first and buckets from 8: the loop starts in the 8 bucket and must move to the 16
    # one. Every step's logits (not only its tokens) must equal a full forward pass over the prompt and the tokens
    # so far; sampled tokens, so that the steps differ.
    monkeypatch.setattr(steps, "CACHE_CHUNK", 1)
    monkeypatch.setattr(compiled, "MIN_BUCKET", 8)
    model = spread(decoder(positional="rotary"))
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    prompt = torch.randint(4, 64, (2, 3), generator=torch.Generator().manual_seed(4)).masked_fill(~mask, 0)
    request = lm_request(model, prompt, mask, 14, True, 1.0, None, None, None, None, None,
                         torch.Generator().manual_seed(0), None, True)
    with torch.inference_mode():
        got = [(s.tokens.clone(), s.logits.clone()) for s in compiled.compiled_steps(model, request)]
    assert sorted(set(bucket_sizes)) == [8, 16]  # grew once, at slot 8
    assert counters["stats"]["unique_graphs"] == 2  # one graph per bucket
    ids, full_mask = prompt, mask
    with torch.no_grad():
        for tokens, logits in got:
            expected = model(ids, attention_mask=full_mask).logits[:, -1]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
            ids = torch.cat([ids, tokens[:, None]], dim=1)
            full_mask = torch.cat([full_mask, torch.ones(2, 1, dtype=torch.bool)], dim=1)
    assert len(got) == 14 and len(set(ids[0, 3:].tolist())) > 5  # non-trivial: many different tokens


def test_huge_max_new_tokens_compiles_over_the_first_bucket_only(graph_backend: None, bucket_sizes: list[int]) -> None:
    # EOS at the first token: with max_new_tokens = 2**21 the old code preallocated a 2**21-slot bucket per layer.
    model = decoder(positional="rotary")
    prompt = torch.tensor([[7, 8, 9]])
    eos = int(model.generate(prompt, max_new_tokens=1, eos_token_id=None)[0, -1])
    out = model.generate(prompt, max_new_tokens=2**21, eos_token_id=eos, compile=True)
    assert out.tolist() == [[7, 8, 9, eos]]
    # The prompt and CACHE_CHUNK = 256 new tokens, rounded up to a power of two: 512 slots.
    assert steps.CACHE_CHUNK == 256 and bucket_sizes == [512] * 2  # one per layer


# ================================================================================= one compiled region for every layer
def checked_steps(model: DecoderLM, request: LMRequest) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``request``'s compiled steps, asserting that each step's logits equal a full forward pass over the
    prompt and the tokens so far. Returns the ids (prompt and tokens) and the steps' logits stacked."""
    with torch.inference_mode():
        got = [(s.tokens.clone(), s.logits.clone()) for s in compiled.compiled_steps(model, request)]
    ids = request.prompt
    with torch.no_grad():
        for tokens, logits in got:
            torch.testing.assert_close(logits, model(ids).logits[:, -1], atol=1e-4, rtol=1e-4)
            ids = torch.cat([ids, tokens[:, None]], dim=1)
    return ids, torch.stack([logits for _, logits in got])


def test_layers_share_one_compiled_region(monkeypatch: pytest.MonkeyPatch) -> None:
    # Unfrozen steps trace each decoder-layer structure once (a nested compile region) and call it for every layer
    # with that layer's weights: 5 calls of one subgraph, and the logits of every step equal eager's.
    graphs = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(compiled, "BACKEND", recording_backend)
    torch._dynamo.reset()
    model = spread(decoder(positional="rotary", n_layers=5, n_kv_heads=2))
    prompt = torch.randint(4, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    request = lm_request(model, prompt, None, 8, False, 1.0, None, None, None, None, None, None, None, True)
    ids, _ = checked_steps(model, request)
    assert torch.equal(ids, model.generate(prompt, max_new_tokens=8, eos_token_id=None))
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 5 and len({n.args[0].target for n in calls}) == 1
    # The region runs under the step's SmallRowsLinear too: its one-row products are reductions, not F.linear.
    region = getattr(gm, calls[0].args[0].target)
    targets = {n.target for n in region.graph.nodes if n.op in ("call_function", "call_method")}
    assert torch._C._nn.linear not in targets and torch.nn.functional.linear not in targets and "sum" in targets
    torch._dynamo.reset()


def test_one_row_steps_are_not_frozen_and_share_regions() -> None:
    # A batch-1 step takes the reductions (which read weights that are graph inputs as fast as constants), so it is
    # not frozen and compiles one region per layer structure; several rows keep the frozen, packed GEMMs.
    model, cpu = decoder(), torch.device("cpu")
    one = compiled.compile_step(compiled.next_token_logits, model, cpu, 1)
    several = compiled.compile_step(compiled.next_token_logits, model, cpu, 4)
    assert one.regional and not one.options.get("freezing")
    assert not several.regional and several.options["freezing"]
    assert compiled.compile_step(compiled.next_token_logits, model, cpu, 1) is one


def test_skipping_steps_check_their_inputs_only_and_follow_the_guarded_call(graph_backend: None) -> None:
    # Steps after a loop's first (guarded) call check only the diff guards on their own inputs, not the model's
    # buffers; when the model's structure changes between loops (a module swapped here), each loop's guarded call
    # picks the matching graph and its skipping steps keep it: every loop equals eager decoding of the model as it
    # is then.
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = spread(decoder(positional="rotary"))
    prompt = torch.randint(4, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, 5, dtype=torch.bool)

    def both() -> torch.Tensor:
        # Sampled steps (so that they differ), each step's logits against a full forward of the model as it is.
        request = lm_request(model, prompt, mask, 10, True, 1.0, None, None, None, None, None,
                             torch.Generator().manual_seed(0), None, True)
        return checked_steps(model, request)[1]

    plain = both()
    (step,) = [run for _, run in compiled._COMPILED[model].values()]
    (entry,) = _debug_get_cache_entry_list(step.code)
    sources = list(entry.guard_manager.diff_guard_sources)
    assert sources and not any(s.startswith("L['args'][0]") for s in sources)  # nothing under the model
    assert any(s.startswith("L['args'][3]") for s in sources)  # the caches are still checked
    class Tripled(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * 3.0

    ffn = model.layers[0].ffn
    model.layers[0].ffn = Tripled(ffn)
    tripled = both()
    assert len(_debug_get_cache_entry_list(step.code)) == 2 and not torch.allclose(tripled, plain, atol=0.1)
    model.layers[0].ffn = ffn
    assert torch.allclose(both(), plain)
    model.layers[0].ffn = Tripled(ffn)
    assert torch.allclose(both(), tripled) and len(_debug_get_cache_entry_list(step.code)) == 2
    for entry in _debug_get_cache_entry_list(step.code):  # the older entry too, after dynamo reset its diff guards
        # Of the model, at most the path to the module whose guard told the entries apart (dynamo keeps guards that
        # have failed): no buffer, nothing of another layer.
        kept = [s for s in entry.guard_manager.diff_guard_sources if s.startswith("L['args'][0]")]
        assert len(kept) <= 12 and not any("_buffers" in s or "['1']" in s for s in kept), kept
