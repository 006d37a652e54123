"""Harnesses for lab 6's exercises 6.3 and 6.4: the student's device mesh on real gloo ranks.

``mesh_worker`` builds the student's process groups (``labkit.lab6.device_mesh``, exercise 6.3)
next to PyTorch's ``init_device_mesh`` (the reference) and all-reduces along every axis in both.
"""
from __future__ import annotations


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
