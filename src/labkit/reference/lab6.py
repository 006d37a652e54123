"""References for lab 6's exercises 6.3 and 6.4: PyTorch's own sharding, measured per rank.

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
