"""The tests' own helper for what an object holds (tests/_given.py's held_bytes): every route a
tensor can be kept by is counted, each storage once (exact byte counts)."""
from __future__ import annotations

import functools

import torch

from _given import held_bytes


class _Holder:
    pass


class _Callable:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


def test_held_bytes_counts_every_route_a_tensor_can_be_kept_by_once():
    """Attributes, containers, closures, default values, partials, bound methods and callable
    objects each keep a 4-byte tensor; a view of one counts its storage once; a skipped one and
    a tensor of an nn.Module's (not walked) count nothing."""
    ts = [torch.zeros(1) for _ in range(7)]
    obj = _Holder()
    obj.plain, obj.listed = ts[0], [{"k": (ts[1], ts[1][:1])}]
    obj.closure = (lambda t: lambda: t)(ts[2])
    obj.default = lambda t=ts[3]: t
    obj.partial = functools.partial(torch.add, ts[4])
    obj.method = _Callable(ts[5]).__call__
    obj.callable = _Callable(ts[6])
    obj.skipped, obj.module = torch.zeros(10), torch.nn.Linear(10, 10)
    assert held_bytes(obj, skip=[obj.skipped]) == 4 * 7
