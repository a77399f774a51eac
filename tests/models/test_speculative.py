"""Speculative decoding: greedy identical to plain greedy, sampling follows the target's distribution exactly."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy import stats
from torch._dynamo.utils import counters

import models.generation.compiled as compiled
import models.generation.steps as steps
from models import DecoderLM, DecoderLMConfig
from models.generation.sampling import SamplingParams
from models.generation.speculative import speculative_decode, verify_draft
from tests.models.test_kv_cache import build

#: A tiny vocabulary, so that the joint distribution of two tokens has few cells for the statistical tests.
TINY_VOCAB = 5


def decoder(seed: int, vocab_size: int = 40, n_layers: int = 2, **overrides: object) -> DecoderLM:
    config = dict(vocab_size=vocab_size, d_model=16, n_heads=2, d_ff=32, n_layers=n_layers, max_len=64, dropout=0.0)
    model = build(DecoderLM, DecoderLMConfig(**{**config, **overrides}), seed)
    with torch.no_grad():  # sharper distributions than the 0.02-std init, so that the draft often disagrees
        for p in model.parameters():
            p.mul_(8.0)
    return model


def perturbed(model: DecoderLM, scale: float) -> DecoderLM:
    """A copy of ``model`` with noise of ``scale`` times each weight's std added: a draft that mostly agrees."""
    copy = build(DecoderLM, model.config, 0)
    copy.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().nan_to_num(0.0))
    return copy


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("positional", ["learned", "rotary"])
def test_greedy_is_identical_to_plain_greedy(k: int, positional: str) -> None:
    target = decoder(0, positional=positional)
    draft = perturbed(target, 0.3)  # agrees with the target often, not always
    prompt = torch.randint(4, 40, (1, 5), generator=torch.Generator().manual_seed(k))
    for eos in (None, target.config.eos_token_id):
        plain = target.generate(prompt, max_new_tokens=23, eos_token_id=eos)
        fast = speculative_decode(target, draft, prompt, max_new_tokens=23, num_draft_tokens=k, eos_token_id=eos)
        assert torch.equal(fast.sequences, plain)
        assert torch.equal(target.generate(prompt, max_new_tokens=23, eos_token_id=eos, draft_model=draft,
                                           num_draft_tokens=k), plain)
    assert 0.0 < fast.acceptance_rate < 1.0  # both accepted and rejected proposals were exercised
    assert torch.equal(speculative_decode(target, decoder(1, n_layers=1, positional=positional), prompt,
                                          max_new_tokens=23, num_draft_tokens=k).sequences[:, :28], plain[:, :28])
    # The target as its own draft: every proposal is accepted, k + 1 tokens per target pass.
    same = speculative_decode(target, target, prompt, max_new_tokens=23, num_draft_tokens=k, eos_token_id=None)
    assert same.acceptance_rate == 1.0 and same.rounds == -(-23 // (k + 1))


def test_rejection_rule_reproduces_the_target_distribution() -> None:
    # Two draft tokens over V = 5; the target's second and third distributions depend on the tokens before them,
    # as a language model's do. The first two emitted tokens must follow p1(a) p2(b | a) exactly.
    g = torch.Generator().manual_seed(0)
    v, n = TINY_VOCAB, 200_000
    p1, p2, p3 = (torch.rand(shape, generator=g) ** 3 for shape in [(v,), (v, v), (v, v, v)])
    q1, q2 = (torch.rand(shape, generator=g) ** 3 for shape in [(v,), (v, v)])
    p1, p2, p3, q1, q2 = (t / t.sum(-1, keepdim=True) for t in (p1, p2, p3, q1, q2))
    x1 = torch.multinomial(q1, n, replacement=True, generator=g)
    x2 = torch.multinomial(q2[x1], 1, generator=g).squeeze(1)
    target = torch.stack([p1.expand(n, v), p2[x1], p3[x1, x2]], dim=1)  # (N, 3, V)
    draft = torch.stack([q1.expand(n, v), q2[x1]], dim=1)
    accepted, nxt = verify_draft(target, draft, torch.stack([x1, x2], dim=1), g)
    first = torch.where(accepted >= 1, x1, nxt)
    second = torch.where(accepted >= 2, x2, torch.where(accepted == 1, nxt, -1))
    # Rows that rejected x1 emit one token only; their second token comes from the target's next round,
    # which draws from p2(. | first) — the same conditional — so the first token alone is checked on those.
    counts = torch.zeros(v * v)
    both = second >= 0
    counts.index_add_(0, (first * v + second)[both], torch.ones(int(both.sum())))
    expected = (p1[:, None] * p2).flatten()
    # P(first = a, second emitted in this round, = b): the second token is emitted iff x1 was accepted.
    accept1 = torch.minimum(p1, q1)  # P(x1 = a and accepted) = q1(a) min(1, p1(a)/q1(a))
    expected_both = (accept1[:, None] * p2).flatten()
    observed_first = torch.bincount(first, minlength=v).double() / n
    tv_first = 0.5 * (observed_first - p1.double()).abs().sum()
    chi2 = stats.chisquare(counts.numpy(), expected_both.numpy() / expected_both.sum().item() * counts.sum().item())
    tv_joint = 0.5 * (counts / counts.sum() - expected_both / expected_both.sum()).abs().sum()
    assert tv_first < 0.01 and tv_joint < 0.01 and chi2.pvalue > 1e-3
    # The bound means something: the draft's own distribution is far from the target's.
    assert 0.5 * (q1 - p1).abs().sum() > 0.1 and 0.5 * ((q1[:, None] * q2).flatten() - expected).abs().sum() > 0.1
    # A wrong rule (always accept the draft's token) fails the same bound.
    assert 0.5 * (torch.bincount(x1, minlength=v).double() / n - p1.double()).abs().sum() > 0.05


def test_sampled_speculative_decoding_follows_the_target_distribution() -> None:
    # End to end through the models: two new tokens with k = 1 draft token, 1500 runs, against the exact joint
    # distribution of the target (brute force over the 25 continuations), temperature and top-k included.
    target = decoder(0, vocab_size=TINY_VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    draft = decoder(5, vocab_size=TINY_VOCAB, n_layers=1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    params = SamplingParams(do_sample=True, temperature=1.5, top_k=4)
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        exact = torch.zeros(TINY_VOCAB, TINY_VOCAB)
        p1 = params.probabilities(target(prompt).logits[0, -1])
        for a, b in itertools.product(range(TINY_VOCAB), repeat=2):
            p2 = params.probabilities(target(torch.tensor([[1, 2, 3, a]])).logits[0, -1])
            exact[a, b] = p1[a] * p2[b]
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(TINY_VOCAB, TINY_VOCAB)
    runs = 1500
    accepted = 0
    for _ in range(runs):
        out = speculative_decode(target, draft, prompt, max_new_tokens=2, num_draft_tokens=1, sampling=params,
                                 generator=g)
        a, b = out.sequences[0, 3:].tolist()
        counts[a, b] += 1
        accepted += out.accepted
    keep = exact.flatten() > 0
    assert counts.flatten()[~keep].sum() == 0  # top-k removed these continuations: never emitted
    chi2 = stats.chisquare(counts.flatten()[keep].numpy(), (exact.flatten()[keep] * runs).numpy())
    assert chi2.pvalue > 1e-3
    assert 0 < accepted < runs  # both branches of the rule ran


def test_sampling_object_equals_the_keyword_arguments() -> None:
    model = decoder(0)
    prompt = torch.tensor([[5, 6, 7]])
    kwargs = dict(do_sample=True, temperature=0.7, top_k=10, top_p=0.9)
    by_keywords = model.generate(prompt, max_new_tokens=8, generator=torch.Generator().manual_seed(3), **kwargs)
    by_object = model.generate(prompt, max_new_tokens=8, generator=torch.Generator().manual_seed(3),
                               sampling=SamplingParams(**kwargs))
    assert torch.equal(by_keywords, by_object)
    streamed = model.stream(prompt, max_new_tokens=8, generator=torch.Generator().manual_seed(3),
                            sampling=SamplingParams(**kwargs))
    assert torch.equal(torch.stack(list(streamed), dim=1), by_object[:, 3:])
    with pytest.raises(ValueError, match="either sampling= or the keyword arguments \\['top_k'\\]"):
        model.generate(prompt, sampling=SamplingParams(do_sample=True), top_k=5)
    with pytest.raises(ValueError, match="sampling must be a SamplingParams"):
        model.generate(prompt, sampling={"do_sample": True})


def test_bad_draft_or_request_raises() -> None:
    target, prompt = decoder(0), torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="vocab_size=41, the target has 40"):
        target.generate(prompt, draft_model=decoder(1, vocab_size=41))
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 1, got 0"):
        target.generate(prompt, draft_model=decoder(1), num_draft_tokens=0)
    with pytest.raises(ValueError, match="batch size 2"):
        target.generate(prompt.repeat(2, 1), draft_model=decoder(1))
    with pytest.raises(ValueError, match="repetition_penalty=1.3"):
        target.generate(prompt, draft_model=decoder(1), repetition_penalty=1.3)
    with pytest.raises(ValueError, match="draft_model must be a DecoderLM"):
        target.generate(prompt, draft_model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="max_len=8"):
        target.generate(prompt, max_new_tokens=10, draft_model=decoder(1, max_len=8))


def test_one_target_pass_per_round_and_the_draft_never_reruns_accepted_tokens() -> None:
    # The cost model of the paper (§3.2): per round the target runs once over the last token + every proposal,
    # the draft runs once per proposal over tokens its cache has not seen.
    target = decoder(0)
    prompt = torch.randint(4, 40, (1, 6), generator=torch.Generator().manual_seed(0))
    # A draft with some rejections, and an exact copy of the target (all accepted: the draft gets 2 new tokens
    # per round, the last proposal and the target's bonus token).
    for draft in (perturbed(target, 0.1), perturbed(target, 0.0)):
        fed: dict[str, list[int]] = {"target": [], "draft": []}
        hooks = [model.register_forward_pre_hook(
                     lambda m, args, kw, fed=fed, name=name: fed[name].append(args[0].shape[1]), with_kwargs=True)
                 for name, model in (("target", target), ("draft", draft))]
        out = speculative_decode(target, draft, prompt, max_new_tokens=30, num_draft_tokens=4, eos_token_id=None)
        for hook in hooks:
            hook.remove()
        n = out.sequences.shape[1] - prompt.shape[1]
        assert n == 30 and 0 < out.accepted and len(fed["target"]) == out.rounds
        # Round 1 feeds the prompt + its proposals; every later round the previous round's last token + proposals.
        assert sum(fed["target"]) == prompt.shape[1] - 1 + out.rounds + out.proposed
        # Each position once, except proposals after a rejection (fed to the draft, then dropped).
        assert sum(fed["draft"]) <= prompt.shape[1] + n + out.proposed - out.accepted
        assert len(fed["draft"]) == out.proposed and max(fed["draft"][1:]) <= 2
    assert out.acceptance_rate == 1.0 and fed["draft"][1:].count(2) == out.rounds - 1


def test_compiled_draft_keeps_greedy_identity_with_one_graph(graph_backend: None) -> None:
    target = decoder(0, positional="rotary")
    draft = perturbed(target, 0.1)
    g = torch.Generator().manual_seed(0)
    for length, k in [(1, 1), (5, 3), (9, 6), (5, 3)]:  # one cache bucket; the last call repeats a shape
        prompt = torch.randint(4, 40, (1, length), generator=g)
        for eos in (None, target.config.eos_token_id):
            plain = target.generate(prompt, max_new_tokens=23, eos_token_id=eos)
            fast = speculative_decode(target, draft, prompt, 23, k, eos_token_id=eos, compile=True)
            assert torch.equal(fast.sequences, plain)
            # The compiled draft proposes what the eager draft proposes: the same rounds, the same acceptances.
            eager = speculative_decode(target, draft, prompt, 23, k, eos_token_id=eos)
            assert (fast.proposed, fast.accepted) == (eager.proposed, eager.accepted)
    # One graph for every step, rollback, prompt length, k and call.
    assert counters["stats"]["unique_graphs"] == 1 and counters["frames"]["total"] == 1
    sampled = speculative_decode(target, draft, prompt, 23, 3, eos_token_id=None, compile=True,
                                 sampling=SamplingParams(do_sample=True), generator=torch.Generator().manual_seed(0))
    assert sampled.sequences.shape == (1, 5 + 23) and sampled.proposed > 0


def test_compiled_draft_grows_its_bucket_with_the_same_proposals(
    graph_backend: None, bucket_sizes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Room for one new token at first and buckets from 8: the draft's cache moves 8 -> 16 -> 32 mid-round, with
    # rollbacks on either side of each move.
    monkeypatch.setattr(steps, "CACHE_CHUNK", 1)
    monkeypatch.setattr(compiled, "MIN_BUCKET", 8)
    target = decoder(0, positional="rotary")
    draft = perturbed(target, 0.3)
    prompt = torch.randint(4, 40, (1, 5), generator=torch.Generator().manual_seed(3))
    plain = target.generate(prompt, max_new_tokens=23, eos_token_id=None)
    fast = speculative_decode(target, draft, prompt, 23, 3, eos_token_id=None, compile=True)
    eager = speculative_decode(target, draft, prompt, 23, 3, eos_token_id=None)
    assert torch.equal(fast.sequences, plain)
    assert (fast.proposed, fast.accepted) == (eager.proposed, eager.accepted) and 0 < fast.accepted < fast.proposed
    assert sorted(set(bucket_sizes)) == [8, 16, 32]
    assert counters["stats"]["unique_graphs"] == 3  # one graph per bucket


def test_compiled_draft_with_huge_max_new_tokens_allocates_the_first_bucket_only(
    graph_backend: None, bucket_sizes: list[int]
) -> None:
    target = decoder(0, positional="rotary")
    prompt = torch.tensor([[7, 8, 9]])
    eos = int(target.generate(prompt, max_new_tokens=1, eos_token_id=None)[0, -1])
    out = speculative_decode(target, perturbed(target, 0.1), prompt, 2**21, 3, eos_token_id=eos, compile=True)
    assert out.sequences.tolist() == [[7, 8, 9, eos]]
    # The draft's bucket: the prompt and CACHE_CHUNK = 256 new tokens, rounded up (it was 2**21 + 3 slots).
    assert steps.CACHE_CHUNK == 256 and bucket_sizes == [512] * 2  # one per draft layer


def test_bad_compile_request_raises() -> None:
    target, prompt = decoder(0), torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="compile must be True or False, got 'yes'"):
        speculative_decode(target, decoder(1), prompt, compile="yes")
    with pytest.raises(ValueError, match="attention backends, the model uses 'flex'"):
        speculative_decode(target, decoder(1, attention_backend="flex"), prompt, compile=True)
