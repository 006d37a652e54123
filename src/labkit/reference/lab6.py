"""References for lab 6's exercises 6.3, 6.4 and 6.6: PyTorch's own sharding, measured per rank,
and the plain single-device mixture-of-experts layer (``moe_reference``).

The bytes a grader of exercise 6.4 compares the student's memory model with: FSDP2's
``fully_shard`` (ZeRO-3) and ``parallelize_module`` (tensor parallelism) on gloo ranks, each rank
reporting the local bytes of its parameters, gradients and Adam states after one step. Imports no
lab package (``tests/test_layout.py``).
"""
from __future__ import annotations

import torch


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Adam's moment tensors (its step counters excluded)."""
    return [v for st in opt.state.values() for k, v in st.items()
            if k != "step" and isinstance(v, torch.Tensor)]


def fsdp2_step(rank: int, world_size: int, model: torch.nn.Module, batch) -> dict:
    """One Adam step of ``model`` under FSDP2 ``fully_shard`` (ZeRO-3) on ``world_size`` gloo ranks.

    Every block and then the root are sharded over a 1-D CPU mesh. Returns this rank's bytes
    of parameters, gradients and optimizer states (the local shards of the DTensors; Adam's
    step counters excluded) after the step, before ``zero_grad``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch
    model(x, y).backward()
    opt.step()
    params = list(model.parameters())
    return {"parameters": sum(_local_bytes(p) for p in params),
            "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer states": sum(_local_bytes(v) for v in _state_tensors(opt))}


def tensor_parallel_mlp_step(rank: int, world_size: int, model: torch.nn.Module, x: torch.Tensor) -> dict:
    """One Adam step of the MLPs of ``model``'s blocks under tensor parallelism on gloo ranks.

    ``parallelize_module`` shards each block's ``mlp.c_fc`` column-wise and ``mlp.c_proj``
    row-wise (Megatron's MLP: one all-reduce in forward) over a 1-D CPU mesh of ``world_size``;
    the MLPs run on the hidden states ``x`` (the same on every rank) and take one Adam step.
    Returns this rank's bytes of the MLPs' parameters, gradients and optimizer states (local
    shards; Adam's step counters excluded) and the number of MLP parameters.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (world_size,))
    mlps = [block.mlp for block in model.h]
    n_params = sum(p.numel() for m in mlps for p in m.parameters())
    for mlp in mlps:
        parallelize_module(mlp, mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
    params = [p for m in mlps for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    h = x
    for mlp in mlps:
        h = h + mlp(h)
    h.pow(2).mean().backward()
    opt.step()
    return {"n_params": n_params,
            "parameters": sum(_local_bytes(p) for p in params),
            "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer states": sum(_local_bytes(v) for v in _state_tensors(opt))}


# ---------------------------------------------------------------- 6.6 expert parallelism

def moe_reference(layer, x: torch.Tensor, capacity_factor: float | None = None,
                  groups: int = 1) -> torch.Tensor:
    """A ``labkit.moe.MoELayer`` on one device, token by token: the plain computation exercise
    6.6's expert parallelism must equal (outputs, and gradients through autograd).

    ``x`` (groups·T, n_embd) holds ``groups`` consecutive groups of T tokens (one per rank).
    Without ``capacity_factor`` every token gets all k of its experts. With it each expert takes
    at most C = ``labkit.moe.capacity(T, E, k, capacity_factor)`` tokens *of each group*, the
    slots claimed in GShard's order (every token's first choice in token order, then every
    token's second choice, ...); a token beyond C gets nothing from that expert."""
    from labkit.moe import capacity, route

    n = x.shape[0]
    if groups < 1 or n % groups:
        raise ValueError(f"groups must divide the {n} tokens, got {groups}")
    T, E, k = n // groups, layer.n_expert, layer.top_k
    weights, expert_ids = route(layer.router, x, k)
    rows = [torch.zeros_like(x[0]) for _ in range(n)]
    for g in range(groups):
        C = capacity(T, E, k, capacity_factor) if capacity_factor is not None else T * k
        taken = [0] * E
        for j in range(k):
            for t in range(g * T, (g + 1) * T):
                e = int(expert_ids[t, j])
                if taken[e] < C:
                    taken[e] += 1
                    rows[t] = rows[t] + weights[t, j].to(x.dtype) * layer.experts[e](x[t])
    return torch.stack(rows)
