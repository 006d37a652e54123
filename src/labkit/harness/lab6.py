"""Harnesses for lab 6: the student's allocator simulator on a trace, and device mesh on ranks.

``replay`` runs a trace (``labkit.allocation_trace``) through the student's ``CachingAllocator``
(exercise 6.1) and records allocated, reserved and requested bytes after every event.
``mesh_worker`` builds the student's process groups (``labkit.lab6.device_mesh``, exercise 6.3)
next to PyTorch's ``init_device_mesh`` (the reference) and all-reduces along every axis in both.
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
