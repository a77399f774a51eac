"""gpt-oss's MoE parts against ``transformers``' ``GptOssMLP``: the biased top-k-softmax router and the clamped
SwiGLU expert (gate/up interleaved in ``gate_up_proj``), with weights large enough that the clamps bite."""

from __future__ import annotations

import pytest
import torch
import transformers

import blocks
from blocks.moe import MixtureOfExperts

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see tests/conftest.py

D_MODEL, D_FF, N_EXPERTS, TOP_K = 24, 20, 5, 3


def gpt_oss_mlp(scale: float) -> torch.nn.Module:
    config = transformers.GptOssConfig(hidden_size=D_MODEL, intermediate_size=D_FF, num_local_experts=N_EXPERTS,
                                       num_experts_per_tok=TOP_K, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=8)
    mlp = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return mlp.eval()


def zoo_block(mlp: torch.nn.Module) -> MixtureOfExperts:
    """The zoo block with ``mlp``'s weights: ``gate_up_proj`` ``(E, H, 2I)`` holds gate and up in alternate columns."""
    block = blocks.build("ffn", "moe", d_model=D_MODEL, d_ff=D_FF, bias=True, n_experts=N_EXPERTS, top_k=TOP_K,
                         router="topk_softmax", router_bias=True, expert="clamped_swiglu").eval()
    ex = mlp.experts
    with torch.no_grad():
        block.router.weight.copy_(mlp.router.weight)
        block.router.bias.copy_(mlp.router.bias)
        for e, expert in enumerate(block.experts):
            expert.gate_proj.weight.copy_(ex.gate_up_proj[e][:, ::2].T)
            expert.gate_proj.bias.copy_(ex.gate_up_proj_bias[e][::2])
            expert.up_proj.weight.copy_(ex.gate_up_proj[e][:, 1::2].T)
            expert.up_proj.bias.copy_(ex.gate_up_proj_bias[e][1::2])
            expert.down_proj.weight.copy_(ex.down_proj[e].T)
            expert.down_proj.bias.copy_(ex.down_proj_bias[e])
    return block


@pytest.mark.parametrize("scale", [0.2, 2.0])  # 2.0: pre-activations far beyond the clamp limit of 7
@torch.no_grad()
def test_router_and_clamped_experts_equal_transformers(scale: float) -> None:
    mlp = gpt_oss_mlp(scale)
    block = zoo_block(mlp)
    x = torch.randn(2, 7, D_MODEL, generator=torch.Generator().manual_seed(1))
    expected, _ = mlp(x)
    torch.testing.assert_close(block(x), expected, atol=1e-4 * scale ** 2, rtol=1e-5)
    logits, scores, indices = mlp.router(x.reshape(-1, D_MODEL))
    weights, experts = block.route(block.router(x.reshape(-1, D_MODEL)))
    assert torch.equal(experts, indices)
    torch.testing.assert_close(weights, scores)
    torch.testing.assert_close(block.router_logits, logits)  # the load-balancing loss reads the biased logits
    if scale > 1:
        gate = block.experts[0].gate_proj(x)
        assert gate.max() > 7 and gate.min() < -7  # the clamps were exercised


def test_topk_softmax_refuses_groups_and_the_expert_refuses_a_bad_limit() -> None:
    with pytest.raises(ValueError, match="router='topk_softmax' does not group experts"):
        blocks.build("ffn", "moe", d_model=8, d_ff=4, n_experts=4, top_k=2, router="topk_softmax", n_group=2,
                     topk_group=1)
    with pytest.raises(ValueError, match="limit=0"):
        blocks.build("ffn", "clamped_swiglu", d_model=8, d_ff=4, limit=0)
