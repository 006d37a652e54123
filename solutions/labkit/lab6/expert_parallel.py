"""Expert parallelism: the experts of an MoE layer sharded over W ranks, tokens sent by all-to-all.

An MoE layer (``labkit.moe.MoELayer``) holds E expert MLPs; at DeepSeek-V3's 256 experts per
layer no GPU keeps them all. Expert parallelism (GShard, Lepikhin et al. 2020,
https://arxiv.org/abs/2006.16668) gives each of W ranks E/W whole experts (rank r: experts
r·E/W … (r+1)·E/W − 1) and leaves each rank its own tokens. A layer's forward is then:

1. **route** each of the rank's T tokens to its k experts (the router is replicated);
2. **assign slots**: each expert takes at most C = ⌈capacity_factor · T · k / E⌉ of the rank's
   tokens, claimed in GShard's order (everyone's first choice, then everyone's second, …);
3. **dispatch**: copy each kept token into its slot of a buffer of shape (E, C, n_embd), zeros
   where a slot is empty; the buffer's rows for rank q's experts are one contiguous block;
4. **all-to-all**: block q goes to rank q, which receives (W, E/W, C, n_embd): the slots every
   rank filled for its experts;
5. each local expert runs on its W·C slots (empty ones are zeros and stay zeros);
6. **all-to-all** back, the inverse exchange: every slot's output returns to the token's rank;
7. **combine**: each token sums its kept slots' outputs weighted by its router weights.

Per layer and micro-batch each rank sends E·C·n_embd elements in each all-to-all, twice in
forward and twice in backward (the backward of an all-to-all is the reverse all-to-all): a
fixed volume set by the capacity factor, whatever the routing. The buffer of E·C slots is
also the memory a capacity factor buys: T·k·capacity_factor token copies, padding included.

Lab 6 (labs/06_system.ipynb), exercise 6.6; chapter 6 (book/06_system.md, "Mixture of experts").
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from labkit.moe import MoELayer, route
from labkit.moe import capacity as expert_capacity  # (the functions below take a capacity argument)
from labkit.validate import number, positive_int, tensor

__all__ = ["all_to_all", "assign_slots", "dispatch", "combine", "ExpertParallelMoE"]


# ==== given: the course's code — read it, call it, don't change it ====

def all_to_all(x: torch.Tensor, group=None) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 over ``group``: block i of W equal blocks of this
    rank's ``x`` goes to rank i of the group, and the result stacks the blocks received from
    ranks 0..W−1 in order. Differentiable: its backward is the same exchange of the gradient,
    in reverse (PyTorch's functional collective ``all_to_all_single_autograd``, as torchtitan's
    expert parallelism calls it)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    out = all_to_all_single_autograd(x.contiguous(), None, None, group or dist.group.WORLD)
    return torch.ops._c10d_functional.wait_tensor(out)


def check_routing(expert_ids, slots=None, *, n_expert, capacity) -> tuple[int, int]:
    """Refuse a routing :func:`assign_slots`, :func:`dispatch` and :func:`combine` cannot use,
    naming the argument: ``expert_ids`` (and ``slots``, when given) (T, k) int64 tensors of one
    shape; ``n_expert`` and ``capacity`` ints ≥ 1 (None: not checked). Returns (T, k)."""
    for name, ids in (("expert_ids", expert_ids), ("slots", slots)):
        if ids is None:
            continue
        tensor(name, ids, ndim=2)
        if ids.dtype != torch.int64:
            raise TypeError(f"{name} must be a (T, k) int64 tensor, got dtype {ids.dtype}")
    if slots is not None and slots.shape != expert_ids.shape:
        raise ValueError(f"slots must have expert_ids' shape (T, k) = {tuple(expert_ids.shape)}, "
                         f"got {tuple(slots.shape)}")
    for name, value in (("n_expert", n_expert), ("capacity", capacity)):
        if value is not None:
            positive_int(name, value)
    return tuple(expert_ids.shape)


# ==== exercise 6.6: your code ====

def assign_slots(expert_ids: torch.Tensor, n_expert: int, capacity: int) -> torch.Tensor:
    """Each (token, choice)'s slot in its expert's buffer, or −1 if the expert is full.

    Contract: slots are claimed in GShard's order — every token's choice 0 in token order,
    then every token's choice 1, … — and each expert gives its slots 0, 1, 2, … to its first
    ``capacity`` claims; later claims get −1 (dropped). No Python loop over tokens.

    Args:
        expert_ids: (T, k) int64 in [0, n_expert), from :func:`labkit.moe.route`.
        n_expert: E. capacity: C ≥ 1.
    Returns:
        (T, k) int64: the slot in [0, C), or −1.
    Raises TypeError/ValueError naming the argument (given: :func:`check_routing`).
    """
    check_routing(expert_ids, n_expert=n_expert, capacity=capacity)
    # BEGIN SOLUTION 6.6: each (token, choice)'s slot in its expert's buffer, claimed in GShard's order; -1 past the capacity
    T, k = expert_ids.shape
    flat = expert_ids.T.reshape(-1)  # (k·T,) choice-major: all first choices, then all second
    onehot = torch.nn.functional.one_hot(flat, n_expert)  # (k·T, E)
    position = (onehot.cumsum(0) - 1).gather(1, flat[:, None])[:, 0]  # claims before this one
    position = torch.where(position < capacity, position, torch.full_like(position, -1))
    return position.reshape(k, T).T
    # END SOLUTION


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, slots: torch.Tensor, n_expert: int,
             capacity: int) -> torch.Tensor:
    """The send buffer: token t's copy for choice j at [expert_ids[t, j], slots[t, j]].

    Contract: a new (n_expert, capacity, n_embd) tensor in x's dtype, zeros in every slot no
    token claimed; dropped choices (slot −1) are not copied; differentiable with respect to
    ``x`` (its gradient sums the gradients of a token's copies). No Python loop over tokens.
    Bad input (x not (T, n_embd) floating point, ids or slots not (T, k) int64): TypeError or
    ValueError naming the argument (given).
    """
    T, _ = check_routing(expert_ids, slots, n_expert=n_expert, capacity=capacity)
    tensor("x", x, floating=True, ndim=2)
    if x.shape[0] != T:
        raise ValueError(f"x must have one row per token of expert_ids, T = {T}, got {x.shape[0]}")
    # BEGIN SOLUTION 6.6: scatter the kept (token, choice) pairs' rows into a zero buffer, differentiably
    T, k = expert_ids.shape
    kept = slots >= 0  # (T, k)
    token = torch.arange(T, device=x.device)[:, None].expand(T, k)[kept]
    where = expert_ids[kept] * capacity + slots[kept]  # row of the flattened (E·C, d) buffer
    source = torch.full((n_expert * capacity,), T, device=x.device)  # row T: a row of zeros
    source[where] = token
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])  # (T + 1, d); autograd keeps no copy
    return padded[source].view(n_expert, capacity, x.shape[1])
    # END SOLUTION


def combine(expert_out: torch.Tensor, expert_ids: torch.Tensor, slots: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
    """Each token's output: Σⱼ weights[t, j] · expert_out[expert_ids[t, j], slots[t, j]] over
    its kept choices (a dropped choice adds nothing).

    Args:
        expert_out: (E, C, n_embd), the experts' outputs in the slots :func:`dispatch` filled.
        expert_ids, slots: (T, k) int64. weights: (T, k) float32 router weights.
    Returns:
        (T, n_embd) in expert_out's dtype; differentiable with respect to expert_out and
        weights. No Python loop over tokens.
    Bad input (shapes or dtypes other than these): TypeError or ValueError naming the argument
    (given).
    """
    check_routing(expert_ids, slots, n_expert=None, capacity=None)
    tensor("expert_out", expert_out, floating=True, ndim=3)
    tensor("weights", weights, floating=True, ndim=2)
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights must have expert_ids' shape (T, k) = {tuple(expert_ids.shape)}, "
                         f"got {tuple(weights.shape)}")
    # BEGIN SOLUTION 6.6: gather each kept choice's row, weight it, sum the choices of each token
    E, C, d = expert_out.shape
    kept = slots >= 0
    rows = expert_ids * C + slots.clamp(min=0)  # (T, k); dropped rows read slot 0, weighted 0
    picked = expert_out.reshape(E * C, d)[rows.reshape(-1)].view(*rows.shape, d)  # (T, k, d)
    w = (weights * kept).to(expert_out.dtype)[..., None]
    return (w * picked).sum(1)
    # END SOLUTION


class ExpertParallelMoE(nn.Module):
    """``layer``'s experts sharded over the ranks of ``group``: each rank keeps the router and
    its E/W experts, and runs the layer on its own tokens.

    Args:
        layer: a ``labkit.moe.MoELayer`` (the same weights on every rank); E must divide by W.
        capacity_factor: > 0; each expert takes ⌈capacity_factor · T · k / E⌉ of a rank's T
            tokens (``labkit.moe.capacity``).
        group: the expert-parallel process group (None: the default group).
    Attributes: ``router`` (a copy), ``experts`` (ModuleList of this rank's E/W experts,
    copies), ``first_expert`` (the global index of ``experts[0]``), ``n_expert``, ``top_k``.
    """

    # ==== given: the course's code — read it, call it, don't change it ====
    def __init__(self, layer: MoELayer, capacity_factor: float, group=None):
        super().__init__()
        import copy

        if not isinstance(layer, MoELayer):
            raise TypeError(f"layer must be a labkit.moe.MoELayer, got {type(layer).__name__}")
        self.capacity_factor = number("capacity_factor", capacity_factor, low=0, low_open=True)
        self.group = group
        W, rank = dist.get_world_size(group), dist.get_rank(group)
        if layer.n_expert % W:
            raise ValueError(f"the number of experts {layer.n_expert} must divide by the "
                             f"expert-parallel world size {W}")
        per_rank = layer.n_expert // W
        self.n_expert, self.top_k, self.first_expert = layer.n_expert, layer.top_k, rank * per_rank
        self.router = copy.deepcopy(layer.router)
        self.experts = nn.ModuleList(copy.deepcopy(layer.experts[self.first_expert + i])
                                     for i in range(per_rank))

    # ==== exercise 6.6: your code ====
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, n_embd) tokens of this rank -> (T, n_embd): route, assign slots, dispatch,
        all-to-all, the local experts, all-to-all back, combine (see the module docstring).

        Contract: exactly two :func:`all_to_all` calls in forward (so two in backward), each
        of E·C·n_embd elements, and no other communication; equal to
        ``labkit.reference.lab6.moe_reference(layer, all ranks' tokens, capacity_factor,
        groups=W)`` on this rank's rows, gradients included.
        """
        tensor("x", x, floating=True, ndim=2)
        positive_int("tokens", x.shape[0])
        # BEGIN SOLUTION 6.6: the seven steps of the module docstring; each local expert on the W·C slots it received
        T, d = x.shape
        E, W = self.n_expert, dist.get_world_size(self.group)
        C = expert_capacity(T, E, self.top_k, self.capacity_factor)
        weights, expert_ids = route(self.router, x, self.top_k)
        slots = assign_slots(expert_ids, E, C)
        send = dispatch(x, expert_ids, slots, E, C)  # (E, C, d): rank q's experts are block q
        received = all_to_all(send, self.group)  # (E, C, d) = (W, E/W, C, d): from each rank
        received = received.view(W, E // W, C, d).transpose(0, 1)  # (E/W, W, C, d)
        outs = [expert(received[i].reshape(W * C, d)).view(W, C, d)
                for i, expert in enumerate(self.experts)]
        back = all_to_all(torch.stack(outs, 1).reshape(E, C, d), self.group)  # (E, C, d) in send's layout
        return combine(back, expert_ids, slots, weights)
        # END SOLUTION
