"""Count the communication one rank performs: calls and bytes per collective.

Communication is the price of every memory saving in this course: ZeRO and FSDP keep 1/N of
the state on each rank and pay for it with all-gathers and reduce-scatters. ``count_comm``
measures that price on the rank that runs it, so a lab can check a formula such as "ZeRO-3
moves 3Ψ per step where DDP moves 2Ψ" (Rajbhandari et al., 2020) against what was sent.

Mechanism: every ``torch.distributed`` call (``all_reduce``, ``all_gather_into_tensor``,
``send``, ...) ends in an operator of the ``c10d`` namespace (``torch.ops.c10d.allreduce_``),
and the functional collectives used by DTensor end in ``torch.ops._c10d_functional.*``. A
``TorchDispatchMode`` sees every operator call on this thread, so ``count_comm`` recognises
those operators and reads the tensors' sizes from their arguments; DDP's gradient all-reduce
and FSDP2's all-gathers and reduce-scatters are seen too. Nothing in ``torch.distributed`` is
patched. (PyTorch's own ``CommDebugMode`` counts collectives the same
way, but in torch 2.13 it ignores ``send``/``recv``/``barrier`` and counts no bytes.)

What the numbers mean, with B the payload of one call and N the size of its process group
(op key: B, counted in ``bytes_sent``; then ``ring_bytes``):

- ``all_reduce``: bytes of the tensor(s) reduced; 2(N-1)/N · B.
- ``all_gather_into_tensor``, ``all_gather``: bytes of the gathered output, N × this rank's
  shard; (N-1)/N · B.
- ``reduce_scatter_tensor``, ``reduce_scatter``: bytes of the full input, N × this rank's
  output shard; (N-1)/N · B.
- ``all_to_all_single``, ``all_to_all``: bytes of this rank's input; (N-1)/N · B.
- ``broadcast``, ``reduce``: bytes of the tensor(s); no ring bytes counted.
- ``gather``, ``scatter``: bytes of the whole gathered or scattered tensor (N × this rank's
  piece); no ring bytes counted.
- ``send`` (and ``isend``): bytes of the tensor sent; B.
- ``recv`` (and ``irecv``): bytes of the tensor received; 0.
- ``barrier``: 0; 0.

``bytes_sent`` is the payload as the caller sees it (for ``recv``, the bytes that arrive, so a
send/recv pair shows the same number on both ends). ``ring_bytes`` is what this rank puts on
the wire with the bandwidth-optimal ring algorithm (Patarasuk and Yuan, 2009); NCCL and gloo
pick their own algorithms, so it is the textbook cost, not a packet capture. Coalesced
variants count once under the plain name, with the bytes of all their tensors;
``all_gather_single``/``reduce_scatter_single`` (torch 2.13's new names) count as
``all_gather_into_tensor``/``reduce_scatter_tensor``.

Used in: the data-parallel, ZeRO and tensor-parallel chapters (``book/``), inside functions run
by :func:`labkit.ranks.launch`.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CommCounts", "count_comm"]

# operator name (namespace-free) -> (op key, how B is read from the arguments)
_C10D_OPS = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "_allgather_base_": ("all_gather_into_tensor", "output"),
    "allgather_into_tensor_coalesced_": ("all_gather_into_tensor", "output"),
    "allgather_": ("all_gather", "output"),
    "allgather_coalesced_": ("all_gather", "output"),
    "_reduce_scatter_base_": ("reduce_scatter_tensor", "input"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor", "input"),
    "reduce_scatter_": ("reduce_scatter", "input"),
    "alltoall_base_": ("all_to_all_single", "input"),
    "alltoall_": ("all_to_all", "input"),
    "broadcast_": ("broadcast", "tensors"),
    "reduce_": ("reduce", "tensors"),
    "gather_": ("gather", "input_times_n"),
    "scatter_": ("scatter", "output_times_n"),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
    "recv_any_source_": ("recv", "tensors"),
    "barrier": ("barrier", "none"),
    "monitored_barrier_": ("barrier", "none"),
}
_FUNCTIONAL_OPS = {  # torch.ops._c10d_functional: B is read from the input and the group size
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather_into_tensor",
    "all_gather_into_tensor_out": "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced": "all_gather_into_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_tensor_out": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "all_to_all_single": "all_to_all_single",
    "broadcast": "broadcast", "broadcast_": "broadcast",
    "isend": "send", "irecv": "recv",
}
_RING_FACTOR = {  # ring_bytes = factor(N) * B
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send": lambda n: 1,
    "recv": lambda n: 0,
    "barrier": lambda n: 0,
}


def _nbytes(x) -> int:
    """Bytes of a tensor or of a (nested) list of tensors."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(item) for item in x)
    return 0


def _group_size(group) -> int:
    """Size of the process group an operator received (a boxed ProcessGroup or a group name)."""
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group).size()
    if isinstance(group, dist.ProcessGroup):
        return group.size()
    return dist.ProcessGroup.unbox(group).size()


def _c10d_payload(rule: str, args) -> tuple[int, int]:
    """(B, N) of a ``torch.ops.c10d`` call; args follow the operator's schema."""
    n = _group_size(args[1]) if rule in ("tensors", "none") else _group_size(args[2])
    if rule == "tensors":  # op(tensors, group, ...)
        return _nbytes(args[0]), n
    if rule == "none":  # barrier(tensor, group, ...): the tensor is a dummy
        return 0, n
    outputs, inputs = args[0], args[1]  # op(outputs, inputs, group, ...)
    if rule == "output":
        return _nbytes(outputs), n
    if rule == "input":
        return _nbytes(inputs), n
    if rule == "input_times_n":  # gather: this rank contributes its input
        return _nbytes(inputs) * n, n
    return _nbytes(outputs) * n, n  # scatter: this rank receives its output


def _functional_payload(key: str, args) -> tuple[int, int]:
    """(B, N) of a ``torch.ops._c10d_functional`` call (DTensor and FSDP's functional path)."""
    if key in ("send", "recv"):  # isend(tensor, peer, tag, group_name)
        return _nbytes(args[0]), _group_size(args[3])
    n = _group_size(args[-1])
    if key == "all_gather_into_tensor":  # (input(s), group_size, group_name): output is N×input
        return _nbytes(args[0]) * n, n
    return _nbytes(args[0]), n


@dataclass
class CommCounts:
    """What one rank communicated inside a ``count_comm()`` block (op key -> number)."""

    calls: Counter = field(default_factory=Counter)
    """Number of calls per op key, e.g. ``{"all_reduce": 2, "send": 1}``."""
    bytes_sent: Counter = field(default_factory=Counter)
    """Payload bytes B per op key (defined per op in the module docstring)."""
    ring_bytes: Counter = field(default_factory=Counter)
    """Bytes this rank sends with the ring algorithm, per op key (float)."""

    def add(self, key: str, payload: int, group_size: int) -> None:
        self.calls[key] += 1
        self.bytes_sent[key] += payload
        if key in _RING_FACTOR:
            self.ring_bytes[key] += _RING_FACTOR[key](group_size) * payload

    def __str__(self) -> str:
        rows = [f"{'op':<24}{'calls':>7}{'bytes':>14}{'ring bytes':>14}"]
        for key in sorted(self.calls):
            ring = f"{self.ring_bytes[key]:,.0f}" if key in self.ring_bytes else "-"
            rows.append(f"{key:<24}{self.calls[key]:>7}{self.bytes_sent[key]:>14,}{ring:>14}")
        return "\n".join(rows)


class _CommCountMode(TorchDispatchMode):
    """Sees each operator call; records those of the c10d namespaces, runs all of them."""

    def __init__(self, counts: CommCounts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func.namespace, func._opname
        if namespace == "c10d" and name in _C10D_OPS:
            key, rule = _C10D_OPS[name]
            self.counts.add(key, *_c10d_payload(rule, args))
        elif namespace in ("_c10d_functional", "_c10d_functional_autograd") and name in _FUNCTIONAL_OPS:
            key = _FUNCTIONAL_OPS[name]
            self.counts.add(key, *_functional_payload(key, args))
        return func(*args, **(kwargs or {}))


@contextmanager
def count_comm() -> Iterator[CommCounts]:
    """Count this rank's collective and point-to-point calls and bytes inside the block.

    Use it inside a function run by ``labkit.ranks.launch`` (each rank counts its own traffic)::

        with count_comm() as c:
            dist.all_reduce(torch.ones(1000))      # 1000 float32 = 4000 bytes
        c.calls["all_reduce"]        # 1
        c.bytes_sent["all_reduce"]   # 4000
        c.ring_bytes["all_reduce"]   # 2(N-1)/N · 4000, e.g. 4000.0 for N = 2

    Returns:
        A :class:`CommCounts` filled in as the block runs; see this module's docstring for the
        exact definition of B and ring bytes per op. Only the calling thread is counted.
    """
    counts = CommCounts()
    with _CommCountMode(counts):
        yield counts
