"""A mixture-of-experts (MoE) layer: a router sends each token to k of E expert MLPs.

An MoE layer replaces a transformer block's MLP by E smaller MLPs, the *experts*, and a
*router*, a linear layer that scores every expert for every token. Each token goes to its k
best-scored experts and its output is their outputs weighted by the softmax of those k scores
(Shazeer et al. 2017, https://arxiv.org/abs/1701.06538; Mixtral's router, Jiang et al. 2024,
https://arxiv.org/abs/2401.04088). So the layer holds E experts' parameters but each token
uses k of them: parameters, gradients and optimizer states scale with E, the FLOPs and the
activations of a token with k (chapter 6, "Mixture of experts").

With a *capacity* an expert takes at most C tokens from each group of T tokens (a device's
micro-batch), C = ⌈capacity_factor · T · k / E⌉ (GShard, Lepikhin et al. 2020,
https://arxiv.org/abs/2006.16668; Switch Transformer, Fedus et al. 2021,
https://arxiv.org/abs/2101.03961): buffers of fixed shape (E, C, hidden) instead of lists of
any length, at the price of dropping the tokens beyond C (their output from that expert is
zero; the residual connection carries them). The order in which tokens claim slots is GShard's:
every token's first choice, in token order, then every token's second choice, and so on.

This module is the course's toolkit: the layer (:class:`MoELayer`), its router
(:func:`route`) and :func:`capacity`. Lab 6's exercise 6.6 (``labkit.lab6.expert_parallel``)
shards its experts over ranks; ``labkit.reference.lab6.moe_reference`` is the plain
single-device computation the graders compare with.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from labkit.validate import number, positive_int, tensor

__all__ = ["Expert", "MoELayer", "route", "capacity"]


class Expert(nn.Module):
    """One expert: a two-layer MLP n_embd → hidden → n_embd with GELU, no biases (an input row
    of zeros gives zeros: the padding of a capacity buffer costs FLOPs, never a wrong value)."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(n_embd, hidden, bias=False)
        self.proj = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., n_embd) -> (..., n_embd)
        return self.proj(F.gelu(self.fc(x)))


def route(router: nn.Linear, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts and their weights (Mixtral's router).

    The router's scores ``x @ router.weight.T`` (T, E) are computed in float32; each token's
    k highest scores pick its experts (``expert_ids``, best first) and the softmax of those k
    scores gives their ``weights`` (each row sums to 1).

    Args:
        router: ``nn.Linear(n_embd, E, bias=False)``.
        x: (T, n_embd) tokens.
        top_k: k, 1 ≤ k ≤ E.
    Returns:
        (weights (T, k) float32, expert_ids (T, k) int64). Differentiable in ``weights`` with
        respect to x and the router's weight.
    """
    tensor("x", x, floating=True, ndim=2)
    E = router.out_features
    k = positive_int("top_k", top_k)
    if k > E:
        raise ValueError(f"top_k must be at most the number of experts {E}, got {k}")
    scores = F.linear(x.float(), router.weight.float())  # (T, E) fp32
    top, expert_ids = scores.topk(k, dim=-1)  # (T, k), best first
    return torch.softmax(top, dim=-1), expert_ids


def capacity(num_tokens: int, n_expert: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert for a group of ``num_tokens`` tokens: ⌈capacity_factor · T · k / E⌉.

    capacity_factor = 1 gives each expert exactly its even share of the T·k assignments; 1.25
    (Switch Transformer's training default) leaves 25% room for imbalance; E/k makes dropping
    impossible (C = T)."""
    T = positive_int("num_tokens", num_tokens)
    E = positive_int("n_expert", n_expert)
    k = positive_int("top_k", top_k)
    cf = number("capacity_factor", capacity_factor, low=0, low_open=True)
    return math.ceil(cf * T * k / E - 1e-9)  # -1e-9: 1.25·8·2/4 = 5.000000000000001 is 5


class MoELayer(nn.Module):
    """E experts and a router; ``forward`` is the plain, dropless computation on one device.

    Args:
        n_embd: width of a token.
        n_expert: E.
        top_k: k experts per token.
        hidden: each expert's inner width (Mixtral: 14336 at n_embd 4096, E = 8, k = 2).
    Attributes: ``router`` (``nn.Linear(n_embd, E, bias=False)``), ``experts`` (ModuleList of E
    :class:`Expert`), ``top_k``.
    """

    def __init__(self, n_embd: int, n_expert: int, top_k: int, hidden: int):
        super().__init__()
        n_embd, hidden = positive_int("n_embd", n_embd), positive_int("hidden", hidden)
        self.n_expert = positive_int("n_expert", n_expert)
        self.top_k = positive_int("top_k", top_k)
        if self.top_k > self.n_expert:
            raise ValueError(f"top_k must be at most n_expert = {n_expert}, got {top_k}")
        self.router = nn.Linear(n_embd, n_expert, bias=False)
        self.experts = nn.ModuleList(Expert(n_embd, hidden) for _ in range(n_expert))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, n_embd) -> (T, n_embd): Σ over each token's k experts of weight × expert(token)."""
        weights, expert_ids = route(self.router, x, self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, choice = (expert_ids == e).nonzero(as_tuple=True)
            if len(token):
                w = weights[token, choice].to(x.dtype)[:, None]
                out = out.index_add(0, token, w * expert(x[token]))
        return out
