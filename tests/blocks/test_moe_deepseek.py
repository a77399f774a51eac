"""DeepSeek's routers in the ``moe`` block against ``transformers``' own routers, and their validation."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

import blocks

D = 16

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see tests/conftest.py


def sorted_choice(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = experts.argsort(dim=-1)
    return experts.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("renormalize", [True, False])
@torch.no_grad()
def test_sigmoid_group_router_equals_deepseek_v3(renormalize: bool) -> None:
    config = transformers.DeepseekV3Config(hidden_size=D, n_routed_experts=12, n_group=4, topk_group=2,
                                           num_experts_per_tok=3, routed_scaling_factor=2.5,
                                           norm_topk_prob=renormalize)
    config.num_local_experts = config.n_routed_experts  # the name transformers' router reads
    torch.manual_seed(0)
    reference = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(reference.weight)
    reference.e_score_correction_bias.normal_(0, 0.5)  # large enough to change the choice
    moe = blocks.build("ffn", "moe", d_model=D, d_ff=8, n_experts=12, top_k=3, router="sigmoid_group", n_group=4,
                       topk_group=2, renormalize=renormalize, routed_scaling_factor=2.5)
    moe.router.weight.copy_(reference.weight)
    moe.e_score_correction_bias.copy_(reference.e_score_correction_bias)
    x = torch.randn(64, D)
    _, weights, experts = reference(x)
    ours = moe.route(moe.router(x))
    expected, actual = sorted_choice(weights, experts), sorted_choice(*ours)
    assert torch.equal(actual[0], expected[0])
    torch.testing.assert_close(actual[1], expected[1], atol=1e-6, rtol=0)
    assert "e_score_correction_bias" in moe.state_dict()  # a checkpoint tensor, not a derived buffer


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
@torch.no_grad()
def test_softmax_routers_equal_deepseek_v2(method: str) -> None:
    config = transformers.DeepseekV2Config(hidden_size=D, num_attention_heads=4, n_routed_experts=12, n_group=3,
                                           topk_group=2, num_experts_per_tok=3, routed_scaling_factor=1.5,
                                           topk_method=method)
    torch.manual_seed(1)
    reference = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(reference.weight)
    grouped = {"router": "softmax_group", "n_group": 3, "topk_group": 2} if method != "greedy" else {}
    moe = blocks.build("ffn", "moe", d_model=D, d_ff=8, n_experts=12, top_k=3, renormalize=False,
                       routed_scaling_factor=1.5, **grouped)
    moe.router.weight.copy_(reference.weight)
    x = torch.randn(64, D)
    _, weights, experts = reference(x)
    expected, actual = sorted_choice(weights, experts), sorted_choice(*moe.route(moe.router(x)))
    assert torch.equal(actual[0], expected[0])
    torch.testing.assert_close(actual[1], expected[1], atol=1e-6, rtol=0)


@torch.no_grad()
def test_a_block_without_routed_experts_is_its_shared_expert() -> None:
    torch.manual_seed(2)
    dense = blocks.build("ffn", "moe", d_model=D, d_ff=8, n_experts=0, top_k=0, d_shared=24,
                         router="sigmoid_group", n_group=4, topk_group=2)
    assert dense.router is None and len(dense.experts) == 0
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(dense(x), dense.shared_expert(x))
    assert dense.router_logits is None  # no router loss from a dense layer


@pytest.mark.parametrize(("options", "named"), [
    ({"router": "nope"}, "unknown router 'nope'"),
    ({"router": "sigmoid_group", "n_group": 4, "topk_group": 5}, "topk_group=5"),
    ({"router": "softmax_group", "n_group": 5, "topk_group": 1}, "n_experts=12 is not divisible by n_group=5"),
    ({"router": "sigmoid_group", "n_group": 6, "topk_group": 1}, "fewer than top_k=3"),
    ({"router": "softmax", "n_group": 2}, "does not group"),
    ({"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
    ({"n_experts": 0}, "n_experts=0 needs top_k=0"),
    ({"top_k": 13}, "top_k=13"),
])
def test_bad_router_options_are_refused_by_name(options: dict, named: str) -> None:
    kwargs = {"d_model": D, "d_ff": 8, "n_experts": 12, "top_k": 3, **options}
    with pytest.raises(ValueError, match=named):
        blocks.build("ffn", "moe", **kwargs)
