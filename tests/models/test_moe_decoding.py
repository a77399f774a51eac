"""A mixture-of-experts model under the decoding and fine-tuning paths: compiled and speculative decoding, int8
weights and LoRA on the expert linears (mixtral-tiny, perturbed so that the routing is not uniform)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from blocks.moe import MixtureOfExperts
from blocks.quantized import Int8Linear
from models import DecoderLM
from training.losses import default_loss

PROMPT = torch.tensor([[5, 6, 7, 8, 9], [3, 1, 4, 1, 5]])
MASK = torch.tensor([[True] * 5, [False, False, True, True, True]])
GREEDY = dict(max_new_tokens=8, eos_token_id=None, pad_token_id=0)


def mixtral(seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    model = DecoderLM.from_preset("mixtral-tiny", vocab_size=64, n_layers=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def model() -> DecoderLM:
    return mixtral()


def test_compiled_decoding_gives_the_eager_tokens(model: DecoderLM, graph_backend: None) -> None:
    """Under compile the block takes its static-shape path (every expert on every token, zero weights)."""
    eager = model.generate(PROMPT, attention_mask=MASK, **GREEDY)
    assert torch.equal(model.generate(PROMPT, attention_mask=MASK, compile=True, **GREEDY), eager)
    torch._dynamo.reset()


def test_speculative_decoding_gives_plain_greedy(model: DecoderLM) -> None:
    draft = mixtral(seed=0)  # its own copy: every drafted token is accepted, verified over several positions
    plain = model.generate(PROMPT[:1], **GREEDY)
    assert torch.equal(model.generate(PROMPT[:1], draft_model=draft, num_draft_tokens=3, **GREEDY), plain)


def test_int8_quantizes_every_expert_linear_keeps_routers_float_and_the_logits_close(tmp_path) -> None:
    model = mixtral()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    n_routers = len(model.layers)
    router = model.layers[0].ffn.router.weight.detach().clone()
    with torch.no_grad():
        before = model(ids).logits
        after = model.quantize("int8")(ids).logits
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == n_linear - n_routers
    assert isinstance(model.layers[0].ffn.experts[4].down_proj, Int8Linear)
    assert all(type(layer.ffn.router) is nn.Linear for layer in model.layers)  # routing stays in float
    assert torch.equal(model.layers[0].ffn.router.weight, router)  # the router's weights are the float ones
    assert 0 < (after - before).norm() / before.norm() <= 0.05
    model.save_pretrained(tmp_path)
    loaded = DecoderLM.from_pretrained(tmp_path)
    assert type(loaded.layers[0].ffn.router) is nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, after)


def test_lora_targets_the_expert_linears_trains_and_merges() -> None:
    model = mixtral()
    targets = model.add_adapter(kind="lora", r=4, alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"])
    assert len(targets) == 5 * 3 and "layers.0.ffn.experts.4.down_proj" in targets
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.5)
    model.train()
    loss = model(ids, labels=ids).loss  # mixtral-tiny carries aux_loss_coef=0.02: the router loss is in it
    loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        adapted = model(ids).logits
        merged = model.merge_and_unload()(ids).logits
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)
    assert all(isinstance(layer.ffn, MixtureOfExperts) for layer in model.layers)


def test_the_trainers_token_loss_includes_the_router_loss() -> None:
    """TokenLoss sums per-token losses (the Trainer divides by the step's tokens): the router loss enters weighted by
    the batch's target tokens, so the Trainer's loss per token is the model's own ``loss``."""
    model = mixtral().train()  # dropout 0: deterministic
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    loss_fn = default_loss(model)
    batch = {"input_ids": ids, "labels": ids}
    expected = model(ids, labels=ids).loss
    torch.testing.assert_close(loss_fn(model, batch) / loss_fn.count(batch), expected, atol=1e-5, rtol=0)
    assert model(ids).aux_loss > 0


@pytest.mark.parametrize("preset", ["gpt_oss-tiny", "qwen3_moe-tiny"])
def test_int8_keeps_other_moe_families_close(preset: str) -> None:
    # int8 works on the other MoE layouts too (gpt-oss: biased router, clamped experts; Qwen3-MoE: 8 of many experts).
    torch.manual_seed(0)
    model = DecoderLM.from_preset(preset, dropout=0.0).eval()
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        after = model.quantize("int8")(ids).logits
    assert 0 < (after - before).norm() / before.norm() <= 0.05
