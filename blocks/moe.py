"""Mixture-of-experts feed-forward network (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021; Mixtral).

A router scores every token against ``n_experts`` experts, each token goes to its ``top_k`` best experts, and the
token's output is the weighted sum of those experts' outputs (plus, for Qwen2-MoE/DeepSeek, a shared expert every
token goes through). Each expert is a registered FFN (``expert="swiglu"`` by default) of width ``d_ff``, so LoRA and
int8 quantization see ordinary ``nn.Linear`` layers (``ffn.experts.<e>.gate_proj`` ...). A shared expert's sigmoid
gate is one more output row of the router (``router.weight[-1]``): router and gate are one matmul.

Tokens are grouped by expert: the ``(token, slot)`` pairs are sorted by expert once, each expert runs one batched
matmul over its group, and the results are scattered back with one ``index_add_``. Under ``torch.compile`` (whose
graphs need static shapes) every expert runs on every token and the unselected outputs get weight zero.

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

from .registry import build, names, register

#: Routers the MoE block knows: ``softmax`` = softmax over all experts, keep the top k (optionally renormalised).
ROUTERS = ("softmax",)


@register("ffn", "moe")
class MixtureOfExperts(nn.Module):
    """Top-k routed experts, optionally with a (sigmoid-gated) shared expert.

    Args:
        d_model: model width.
        d_ff: width of each routed expert.
        dropout: dropout inside each expert.
        bias: biases on the experts' linears (the router has none).
        n_experts: number of routed experts.
        top_k: experts per token (``1 <= top_k <= n_experts``).
        router: ``"softmax"``: probabilities over all experts, the ``top_k`` largest kept.
        renormalize: divide the kept probabilities by their sum (Mixtral; Qwen3-MoE ``norm_topk_prob``); without it
            they are used as they are (OLMoE, Qwen2-MoE).
        expert: registered FFN name of each expert (and of the shared expert).
        d_shared: width of the shared expert every token goes through (0: none).
        shared_gate: scale the shared expert's output by ``sigmoid(x · w)`` (Qwen2-MoE), ``w`` the router's last row.
        aux_loss_coef: weight of the load-balancing loss in ``router_loss``.
        z_loss_coef: weight of the router z-loss (ST-MoE) in ``router_loss``.

    Shapes: ``(..., d_model)`` -> ``(..., d_model)``.

    Raises:
        ValueError: ``top_k`` outside ``[1, n_experts]``, an unknown router or expert, a negative width or
            coefficient (the value named).
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
    ) -> None:
        super().__init__()
        if d_model < 1 or d_ff < 1:
            raise ValueError(f"d_model and d_ff must be >= 1, got d_model={d_model}, d_ff={d_ff}")
        if n_experts < 1:
            raise ValueError(f"n_experts must be >= 1, got n_experts={n_experts}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must lie in [1, n_experts={n_experts}]")
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}; expected one of {list(ROUTERS)}")
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
        self.router = nn.Linear(d_model, n_experts + self.shared_gate, bias=False)
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
        """
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])  # (N, d_model)
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
        tokens = order // self.top_k  # (N·k,) the token of each sorted pair
        groups = h[tokens].split(counts)  # one (n_e, d_model) block per expert
        outs = [self._expert(e, group) for e, group in enumerate(groups) if counts[e]]
        y = torch.cat(outs) * weights.reshape(-1)[order, None]  # (N·k, d_model)
        return h.new_zeros(h.shape).index_add_(0, tokens, y.to(h.dtype))

    def _expert(self, e: int, group: Tensor) -> Tensor:
        if group.shape[0] == 1:
            # One row would take the matrix-vector kernel, whose rounding depends on the weight's address (weights
            # loaded from safetensors sit at 8-byte offsets); two rows take the matrix kernel, as every other group.
            return self.experts[e](group.expand(2, -1).contiguous())[:1]
        return self.experts[e](group)

    def _dense(self, h: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        # Static shapes for compiled graphs: every expert on every token, weight 0 where it was not chosen.
        dense = torch.zeros(h.shape[0], self.n_experts, dtype=weights.dtype, device=h.device)
        dense = dense.scatter(1, experts, weights)  # (N, E)
        out = h.new_zeros(h.shape)
        for e, expert in enumerate(self.experts):
            out = out + dense[:, e:e + 1] * expert(h)
        return out


def load_balancing_loss(logits: Sequence[Tensor], n_experts: int, top_k: int, mask: Tensor | None = None) -> Tensor:
    """The Switch Transformer load-balancing loss (Fedus et al. 2021, eq. 4-6) over several layers' router logits,
    in ``transformers``' form: ``n_experts · Σ_e f_e · P_e`` with ``f_e`` the fraction of (token, slot) assignments
    to expert ``e`` and ``P_e`` its mean router probability, both over every layer's real tokens together.

    Args:
        logits: per layer ``(N, n_experts)`` router logits, ``N = B · L`` tokens in the same order in every layer.
        mask: ``(B, L)`` True = real token (padding is left out), or None.

    Returns:
        A scalar tensor.
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
    ``logsumexp(logits)²``; it keeps router logits small. Arguments as for ``load_balancing_loss``."""
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
