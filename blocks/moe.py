"""Mixture-of-experts feed-forward network (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021; Mixtral).

A router scores every token against ``n_experts`` experts, each token goes to its ``top_k`` best experts, and the
token's output is the weighted sum of those experts' outputs (plus, for Qwen2-MoE/DeepSeek, a shared expert every
token goes through). Each expert is a registered FFN (``expert="swiglu"`` by default) of width ``d_ff``, so LoRA and
int8 quantization see ordinary ``nn.Linear`` layers (``ffn.experts.<e>.gate_proj`` ...). A shared expert's sigmoid
gate is one more output row of the router (``router.weight[-1]``): router and gate are one matmul.

Tokens are grouped by expert: the ``(token, slot)`` pairs are sorted by expert once, each expert runs one batched
matmul over its group, and the results are scattered back with one ``index_add_``. SwiGLU/GeGLU experts of plain
bias-free linears take a faster path with the same values (``blocks/gated_experts.py``: groups of experts in one
autograd node each, a hand-written backward); other experts (LoRA, int8, tensor-parallel, any other FFN) keep
autograd's. Under ``torch.compile`` (whose graphs need static shapes) every expert runs on every token and the
unselected outputs get weight zero.

Training losses: after each forward the block keeps its router logits (``router_logits``, ``(tokens, n_experts)``);
the model calls ``router_loss`` once per forward, which takes (and clears) them from every MoE block and returns
``aux_loss_coef · load-balancing loss + z_loss_coef · router z-loss`` — the load-balancing loss over all layers at once,
as ``transformers``' ``load_balancing_loss_func`` computes it. ``DecoderLM`` adds it to the LM loss when labels are
given; both coefficients are block options (0 by default: no extra loss).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .gated_experts import fast_experts, gated_experts, two_rows
from .registry import build, names, register

#: Routers the MoE block knows: ``softmax`` = softmax over all experts, keep the top k (optionally renormalised);
#: ``softmax_group`` = DeepSeek-V2's ``group_limited_greedy`` (softmax, top k among the ``topk_group`` groups with the
#: largest expert probability); ``sigmoid_group`` = DeepSeek-V3's (sigmoid scores plus a correction bias choose,
#: groups ranked by the sum of their two best biased scores, weights from the unbiased scores); ``topk_softmax`` = keep
#: the top k logits, softmax over them (gpt-oss).
ROUTERS = ("softmax", "softmax_group", "sigmoid_group", "topk_softmax")


@register("ffn", "moe")
class MixtureOfExperts(nn.Module):
    """Top-k routed experts, optionally with a (sigmoid-gated) shared expert.

    Args:
        d_model: model width.
        d_ff: width of each routed expert.
        dropout: dropout inside each expert.
        bias: biases on the experts' linears.
        n_experts: number of routed experts.
        top_k: experts per token (``1 <= top_k <= n_experts``).
        router: ``"softmax"``: probabilities over all experts, the ``top_k`` largest kept; ``"topk_softmax"``: the
            ``top_k`` largest logits kept and a softmax over them (gpt-oss; ``renormalize`` changes nothing).
        renormalize: divide the kept probabilities by their sum (Mixtral; Qwen3-MoE ``norm_topk_prob``); without it
            they are used as they are (OLMoE, Qwen2-MoE).
        expert: registered FFN name of each expert (and of the shared expert).
        d_shared: width of the shared expert every token goes through (0: none).
        shared_gate: scale the shared expert's output by ``sigmoid(x · w)`` (Qwen2-MoE), ``w`` the router's last row.
        aux_loss_coef: weight of the load-balancing loss in ``router_loss``.
        z_loss_coef: weight of the router z-loss (ST-MoE) in ``router_loss``.
        n_group: expert groups of the grouped routers (``n_experts`` must divide into them).
        topk_group: groups a token's experts may come from (grouped routers; ``<= n_group``).
        routed_scaling_factor: multiplies the kept weights (DeepSeek), after any renormalisation.
        router_bias: a bias on the router's linear (gpt-oss).

    ``n_experts=0`` (with ``top_k=0``) leaves only the shared expert: a dense FFN in MoE clothes, for DeepSeek's first
    ``first_k_dense_replace`` layers (a per-layer option). ``sigmoid_group`` keeps the correction bias as the
    persistent buffer ``e_score_correction_bias`` ``(n_experts,)`` (DeepSeek-V3 adjusts it outside the gradient).

    Shapes: ``(..., d_model)`` -> ``(..., d_model)``.

    Raises:
        ValueError: ``top_k`` outside ``[1, n_experts]``, an unknown router or expert, a negative width or
            coefficient, ``n_experts`` not divisible by ``n_group``, ``topk_group`` outside ``[1, n_group]``, or
            fewer experts in ``topk_group`` groups than ``top_k`` (the value named).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        dropout: float = 0.0,
        bias: bool = False,
        n_experts: int = 8,
        top_k: int = 2,
        router: str = "softmax",
        renormalize: bool = True,
        expert: str = "swiglu",
        d_shared: int = 0,
        shared_gate: bool = False,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        router_bias: bool = False,
    ) -> None:
        super().__init__()
        if d_model < 1 or d_ff < 1:
            raise ValueError(f"d_model and d_ff must be >= 1, got d_model={d_model}, d_ff={d_ff}")
        if n_experts < 0:
            raise ValueError(f"n_experts must be >= 0 (0: only the shared expert), got n_experts={n_experts}")
        if n_experts == 0:
            if top_k != 0 or not d_shared:
                raise ValueError(f"n_experts=0 needs top_k=0 and a shared expert, got top_k={top_k}, "
                                 f"d_shared={d_shared}")
        elif not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must lie in [1, n_experts={n_experts}]")
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}; expected one of {list(ROUTERS)}")
        check_groups(n_experts, top_k, n_group, topk_group)
        if router in ("softmax", "topk_softmax") and (n_group, topk_group) != (1, 1):
            raise ValueError(f"router={router!r} does not group experts, got n_group={n_group}, "
                             f"topk_group={topk_group}; use 'softmax_group' or 'sigmoid_group'")
        if not 0.0 < routed_scaling_factor < math.inf:
            raise ValueError(f"routed_scaling_factor must be a finite number > 0, got {routed_scaling_factor!r}")
        experts = [n for n in names("ffn") if n != "moe"]
        if expert not in experts:
            raise ValueError(f"expert={expert!r} is not a registered ffn an expert can be; expected one of {experts}")
        if d_shared < 0:
            raise ValueError(f"d_shared must be >= 0 (0: no shared expert), got d_shared={d_shared}")
        if shared_gate and not d_shared:
            raise ValueError("shared_gate=True needs a shared expert (d_shared > 0), got d_shared=0")
        for name, value in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
            if not 0.0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self.n_experts, self.top_k, self.renormalize = n_experts, top_k, renormalize
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.shared_gate = bool(shared_gate)
        self.router_name, self.n_group, self.topk_group = router, n_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.router = nn.Linear(d_model, n_experts + self.shared_gate, bias=bool(router_bias)) if n_experts else None
        if router == "sigmoid_group" and n_experts:
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts))
        self.experts = nn.ModuleList(
            build("ffn", expert, d_model=d_model, d_ff=d_ff, dropout=dropout, bias=bias) for _ in range(n_experts)
        )
        self.shared_expert = (
            build("ffn", expert, d_model=d_model, d_ff=d_shared, dropout=dropout, bias=bias) if d_shared else None
        )
        #: the router logits of the last forward, ``(tokens, n_experts)``, until ``router_loss`` takes them.
        self.router_logits: Tensor | None = None

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """``(weights, experts)``, both ``(N, top_k)``: the kept experts of each token and their weights.

        Probabilities are computed in float32 (as ``transformers`` does) and returned in the logits' dtype.

        Args:
            logits: the router's logits.

        Returns:
            ``(weights, experts)``.

        Shapes: logits ``(N, n_experts)`` -> ``(N, top_k)`` each.
        """
        if self.router_name == "sigmoid_group":
            return self._route_sigmoid_group(logits)
        if self.router_name == "topk_softmax":  # gpt-oss: the softmax sees the kept logits only
            kept, experts = logits.topk(self.top_k, dim=-1)
            return F.softmax(kept, dim=-1, dtype=torch.float32).to(logits.dtype), experts
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        if self.router_name == "softmax_group":  # DeepSeek-V2: a group's score is its best expert's probability
            groups = probs.view(-1, self.n_group, self.n_experts // self.n_group).amax(dim=-1)  # (N, G)
            probs = probs.masked_fill(~self._group_mask(groups), 0.0)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return weights.to(logits.dtype), experts

    def _group_mask(self, groups: Tensor) -> Tensor:
        """``(N, n_experts)`` bool: the experts of each token's ``topk_group`` best groups (``groups``: ``(N, G)``)."""
        best = groups.topk(self.topk_group, dim=-1).indices
        kept = torch.zeros_like(groups, dtype=torch.bool).scatter(1, best, True)  # (N, G)
        return kept.repeat_interleave(self.n_experts // self.n_group, dim=-1)

    def _route_sigmoid_group(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        # DeepSeek-V3 (§2.1.2 of its report): the bias steers the choice only; weights are the unbiased scores.
        scores = logits.float().sigmoid()  # (N, E)
        biased = scores + self.e_score_correction_bias.float()
        per_group = biased.view(-1, self.n_group, self.n_experts // self.n_group)
        groups = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)  # (N, G)
        experts = biased.masked_fill(~self._group_mask(groups), -math.inf).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.routed_scaling_factor).to(logits.dtype), experts

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])  # (N, d_model)
        if self.router is None:  # no routed experts: the shared expert alone (a dense layer)
            return self.shared_expert(h).reshape(shape)
        scores = self.router(h)  # (N, E) or, with a shared gate, (N, E + 1)
        logits = scores[:, :self.n_experts]
        weights, experts = self.route(logits)  # (N, k)
        if torch.compiler.is_compiling():
            out = self._dense(h, weights, experts)
        else:
            out = self._grouped(h, weights, experts)
        self.router_logits = logits
        if self.shared_expert is not None:
            shared = self.shared_expert(h)
            if self.shared_gate:
                shared = torch.sigmoid(scores[:, self.n_experts:]) * shared
            out = out + shared
        return out.reshape(shape)

    def _grouped(self, h: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        # Sort the N·k (token, slot) pairs by expert: each expert's group is one contiguous slice.
        flat = experts.reshape(-1)  # (N·k,)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        if fast_experts(self.experts, h.dtype):  # SwiGLU/GeGLU experts: one autograd node (blocks/gated_experts.py)
            return gated_experts(h, weights, order, counts, self.top_k, self.experts)
        tokens = order // self.top_k  # (N·k,) the token of each sorted pair
        groups = h[tokens].split(counts)  # one (n_e, d_model) block per expert
        # With gradients, an expert no token chose still runs (on no rows): its weights get zero gradients instead
        # of none, so data-parallel ranks whose tokens chose different experts reduce the same gradients (FSDP2's
        # reduce-scatter covers every parameter of a group or fails on mismatched sizes).
        every = torch.is_grad_enabled()
        outs = [self._expert(e, group) for e, group in enumerate(groups) if counts[e] or every]
        y = torch.cat(outs) * weights.reshape(-1)[order, None]  # (N·k, d_model)
        return h.new_zeros(h.shape).index_add_(0, tokens, y.to(h.dtype))

    def _expert(self, e: int, group: Tensor) -> Tensor:
        return self.experts[e](two_rows(group))[:group.shape[0]]  # a single row through the matrix kernel too

    def _dense(self, h: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        # Static shapes for compiled graphs: every expert on every token, weight 0 where it was not chosen.
        dense = torch.zeros(h.shape[0], self.n_experts, dtype=weights.dtype, device=h.device)
        dense = dense.scatter(1, experts, weights)  # (N, E)
        out = h.new_zeros(h.shape)
        for e, expert in enumerate(self.experts):
            out = out + dense[:, e:e + 1] * expert(h)
        return out


def check_groups(n_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Raise ``ValueError`` unless ``n_group`` groups of experts fit ``n_experts`` and ``topk_group`` of them hold at
    least ``top_k`` experts (every grouped router's precondition; ``n_group=topk_group=1`` is no grouping).

    Args:
        n_experts: routed experts.
        top_k: experts per token.
        n_group: groups the experts are split into.
        topk_group: groups a token's experts may come from.

    Raises:
        ValueError: a group count that is not a positive integer or does not divide ``n_experts``, ``topk_group``
            above ``n_group``, or groups too few to hold ``top_k`` experts.
    """
    for name, value in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")
    if n_experts % n_group:
        raise ValueError(f"n_experts={n_experts} is not divisible by n_group={n_group}")
    if topk_group > n_group:
        raise ValueError(f"topk_group={topk_group} must be <= n_group={n_group}")
    if n_experts and topk_group * (n_experts // n_group) < top_k:
        raise ValueError(f"topk_group={topk_group} groups of {n_experts // n_group} experts hold fewer than "
                         f"top_k={top_k} experts")


def load_balancing_loss(logits: Sequence[Tensor], n_experts: int, top_k: int, mask: Tensor | None = None) -> Tensor:
    """The Switch Transformer load-balancing loss (Fedus et al. 2021, eq. 4-6) over several layers' router logits,
    in ``transformers``' form: ``n_experts · Σ_e f_e · P_e`` with ``f_e`` the fraction of (token, slot) assignments
    to expert ``e`` and ``P_e`` its mean router probability, both over every layer's real tokens together.

    Args:
        logits: per layer ``(N, n_experts)`` router logits, ``N = B · L`` tokens in the same order in every layer.
        n_experts: the number of experts.
        top_k: experts per token.
        mask: ``(B, L)`` True = real token (padding is left out), or None.

    Returns:
        A scalar tensor.

    Shapes: logits ``(N, n_experts)`` each, mask ``(B, L)`` -> ``()``.
    """
    rows = logits[0].shape[0]
    real = torch.ones(rows, device=logits[0].device) if mask is None else mask.reshape(-1).float()
    counts = torch.zeros(n_experts, device=logits[0].device)
    prob_sum = torch.zeros(n_experts, device=logits[0].device)
    for layer in logits:
        probs = F.softmax(layer.float(), dim=-1)
        chosen = probs.topk(top_k, dim=-1).indices  # (N, k)
        counts = counts.scatter_add(0, chosen.reshape(-1), real.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * real[:, None]).sum(0)
    total = real.sum() * len(logits)
    return n_experts * torch.sum((counts / total) * (prob_sum / total))


def router_z_loss(logits: Sequence[Tensor], mask: Tensor | None = None) -> Tensor:
    """The router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): mean over real tokens and layers of
    ``logsumexp(logits)²``; it keeps router logits small.

    Args:
        logits: per layer ``(N, n_experts)`` router logits (as for ``load_balancing_loss``).
        mask: ``(B, L)`` True = real token, or None.

    Returns:
        A scalar tensor.

    Shapes: logits ``(N, n_experts)`` each, mask ``(B, L)`` -> ``()``.
    """
    z = torch.stack([torch.logsumexp(layer.float(), dim=-1) ** 2 for layer in logits])  # (layers, N)
    if mask is None:
        return z.mean()
    real = mask.reshape(-1).float()
    return (z * real).sum() / (real.sum() * len(logits))


def router_loss(modules: Iterable[nn.Module], mask: Tensor | None = None, compute: bool = True) -> Tensor | None:
    """Take the router logits every MoE block among ``modules`` kept from the last forward (clearing them) and
    return ``Σ aux_loss_coef · load_balancing_loss + z_loss_coef · router_z_loss`` over blocks of the same shape
    and coefficients, or None (no MoE block, ``compute=False``, or both coefficients 0). Works inside
    ``torch.compile`` (dynamo replays the attribute writes).

    Args:
        modules: the model's FFN blocks (others are ignored).
        mask: the model's ``(B, L)`` padding mask (True = real), or None; with a longer mask (a cache) its last
            ``L`` columns are used.
        compute: False only clears the kept logits.

    Returns:
        The weighted loss (a scalar), or None.

    Shapes: mask ``(B, L)`` -> ``()``.
    """
    groups: dict[tuple[int, int, float, float], list[Tensor]] = {}
    for module in modules:
        if isinstance(module, MixtureOfExperts):
            logits, module.router_logits = module.router_logits, None
            if logits is not None and (module.aux_loss_coef or module.z_loss_coef):
                key = (module.n_experts, module.top_k, module.aux_loss_coef, module.z_loss_coef)
                groups.setdefault(key, []).append(logits)
    if not compute or not groups:
        return None
    if mask is not None:
        length = next(iter(groups.values()))[0].shape[0] // mask.shape[0]
        mask = mask[:, -length:]
    total = None
    for (n_experts, top_k, aux_coef, z_coef), logits in groups.items():
        loss = aux_coef * load_balancing_loss(logits, n_experts, top_k, mask)
        if z_coef:
            loss = loss + z_coef * router_z_loss(logits, mask)
        total = loss if total is None else total + loss
    return total
