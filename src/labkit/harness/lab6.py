"""Harnesses for lab 6: the student's allocator simulator on a trace (6.1), and their code on real gloo ranks (6.3, 6.6).

``replay`` runs a trace (``labkit.allocation_trace``) through the student's ``CachingAllocator``
(exercise 6.1) and records allocated, reserved and requested bytes after every event.
``mesh_worker`` builds the student's process groups (``labkit.lab6.device_mesh``, exercise 6.3)
next to PyTorch's ``init_device_mesh`` (the reference) and all-reduces along every axis in both.
``run_expert_parallel`` runs the student's ``ExpertParallelMoE`` (exercise 6.6) forward and
backward on each rank's tokens, counting its all-to-alls.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.allocation_trace import check_trace


@dataclass
class ReplayResult:
    """Bytes after every event of a replayed trace."""
    allocated: list[int]
    reserved: list[int]
    requested: list[int]
    segment_log: list[int]
    allocator: "CachingAllocator"  # noqa: F821 (labkit.lab6.caching_allocator's)

    @property
    def peak_allocated(self) -> int:
        return max(self.allocated, default=0)

    @property
    def peak_reserved(self) -> int:
        return max(self.reserved, default=0)


def replay(trace, **allocator_kwargs) -> ReplayResult:
    """Replay a trace in a fresh ``CachingAllocator(**allocator_kwargs)`` (the student's,
    exercise 6.1): the bytes after every event, and the allocator itself."""
    from labkit.lab6.caching_allocator import CachingAllocator

    trace = check_trace(trace)
    alloc = CachingAllocator(**allocator_kwargs)
    handles = {}
    allocated, reserved, requested = [], [], []
    for op, ident, nbytes in trace:
        if op == "alloc":
            handles[ident] = alloc.malloc(nbytes)
        else:
            alloc.free(handles.pop(ident))
        allocated.append(alloc.allocated_bytes)
        reserved.append(alloc.reserved_bytes)
        requested.append(alloc.requested_bytes)
    return ReplayResult(allocated, reserved, requested, list(alloc.segment_log), alloc)


def mesh_worker(rank: int, world_size: int, shape, names) -> dict:
    """Rank body for ``labkit.ranks.launch``: PyTorch's ``init_device_mesh`` and this module's
    groups (exercise 6.3's ``build_process_groups``) side by side, and an all-reduce of ``rank + 1`` along every axis in both."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.lab6.device_mesh import build_process_groups

    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    out = {"torch_mesh": mesh.mesh.tolist(), "torch_groups": {}, "ours": {}, "sums": {},
           "torch_sums": {}}
    ours = build_process_groups(shape, names)
    for axis in names:
        tg = mesh.get_group(axis)
        out["torch_groups"][axis] = dist.get_process_group_ranks(tg)
        out["ours"][axis] = dist.get_process_group_ranks(ours[axis])
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x, group=ours[axis])
        out["sums"][axis] = float(x)
        y = torch.tensor([float(rank + 1)])
        dist.all_reduce(y, group=tg)
        out["torch_sums"][axis] = float(y)
    return out


def run_expert_parallel(rank: int, world_size: int, layer, x, capacity_factor: float,
                        grad_out, groups: int = 1) -> dict:
    """Rank body for ``labkit.ranks.launch``: the student's ``ExpertParallelMoE`` (exercise 6.6)
    over this rank's expert-parallel group, on this rank's tokens.

    The world splits into ``groups`` consecutive groups of W = world_size / groups ranks; the
    layer runs inside each. ``x`` and ``grad_out`` (world_size·T, n_embd) hold every rank's T
    tokens in rank order: this rank takes rows [rank·T, (rank+1)·T). Returns this rank's output
    and input gradient rows, its router's gradient, its experts' gradients by global expert
    index, its expert parameter bytes, and the comm counts of forward and of backward."""

    from labkit.comm_count import count_comm
    from labkit.harness.lab3 import subgroup
    from labkit.lab6.expert_parallel import ExpertParallelMoE

    group, _, _ = subgroup(rank, world_size, groups)
    T = x.shape[0] // world_size
    mine = x[rank * T:(rank + 1) * T].clone().requires_grad_()
    moe = ExpertParallelMoE(layer, capacity_factor, group)
    with count_comm() as fwd:
        out = moe(mine)
    with count_comm() as bwd:
        out.backward(grad_out[rank * T:(rank + 1) * T])
    experts = {moe.first_expert + i: {n: p.grad.clone() for n, p in e.named_parameters()}
               for i, e in enumerate(moe.experts)}
    return {"out": out.detach(), "x_grad": mine.grad, "router_grad": moe.router.weight.grad.clone(),
            "expert_grads": experts,
            "expert_bytes": sum(p.numel() * p.element_size() for p in moe.experts.parameters()),
            "forward": {"calls": dict(fwd.calls), "bytes": dict(fwd.bytes_sent)},
            "backward": {"calls": dict(bwd.calls), "bytes": dict(bwd.bytes_sent)}}


def expert_parallel_saved_bytes(rank: int, world_size: int, layer, tokens: int,
                                capacity_factor: float, seed: int = 1) -> int:
    """Rank body for ``labkit.ranks.launch``: the bytes autograd keeps for backward
    (``labkit.measure.saved_activation_bytes``) when the student's ``ExpertParallelMoE``
    (exercise 6.6) runs forward on ``tokens`` random tokens of this rank."""
    import torch

    from labkit.lab6.expert_parallel import ExpertParallelMoE
    from labkit.measure import saved_activation_bytes

    torch.manual_seed(seed + rank)
    moe = ExpertParallelMoE(layer, capacity_factor)
    x = torch.randn(tokens, layer.router.in_features, requires_grad=True)
    return saved_activation_bytes(lambda: moe(x))
