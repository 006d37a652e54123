"""The given half of Lab 4's DDP communication hooks (exercises 4.4 and 4.5): their states, the
helpers the hooks call, and what keeps a hook's state in the right place across DDP's bucket
rebuild.

``DistributedDataParallel`` assigns its gradient buckets once at construction and *rebuilds*
them after the first iteration, in the order the gradients became ready (``bucket.index()``
then names other parameters). A hook that keeps state per bucket (error feedback, PowerSGD's
warm start) must not keep any before the rebuild. So, as PyTorch's ``powerSGD_hook`` does with
``start_powerSGD_iter`` (which it refuses to set below 2 with error feedback or a warm start),
every hook state here has ``start_iter`` (default 2, with torch's meaning: the number of
iterations, counted from 0, that are DDP's plain all-reduce (:func:`allreduce_mean`) and keep
nothing; from iteration ``start_iter`` on, the hook compresses). :meth:`HookState.compressing`
counts the iterations (one per last bucket, ``bucket.is_last()``, as torch's hook counts them)
and checks that a bucket still holds the parameters it held when its state was first kept: a
rebuild after that (``start_iter=0`` on a fresh DDP) is refused with a RuntimeError, never
silently misplaced.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from labkit.validate import (boolean, is_int, non_negative_int, number, one_of, positive_int,
                             tensor)

__all__ = ["HookState", "allreduce_mean", "done", "SCHEMES", "CompressionState", "keep_count",
           "random_indices", "check_flat", "check_k", "check_compression_state", "PowerSGDState",
           "should_compress", "initial_qs", "orthogonalize_", "check_powersgd_state"]


class HookState:
    """What every hook state here shares: the process group, the iteration count and the
    parameters each bucket held when its state was first kept.

    Args:
        process_group: the group to communicate over (None: the default group).
        start_iter: int ≥ 0, the first iteration (counted from 0, as torch's
            ``start_powerSGD_iter``) that compresses; the iterations before it all-reduce plainly
            and keep no state. DDP rebuilds its buckets after iteration 0; 2, the default, is
            torch's smallest allowed value.
    """

    def __init__(self, process_group=None, *, start_iter: int = 2):
        self.process_group = process_group
        self.start_iter = non_negative_int("start_iter", start_iter)
        self.iteration = 0
        self.buckets: dict[int, tuple] = {}  # bucket index -> its parameters' ids

    def compressing(self, bucket: dist.GradBucket) -> bool:
        """Whether the hook compresses ``bucket`` in this iteration (counting the iteration);
        refuses a bucket whose parameters changed since its state was first kept."""
        iteration = self.iteration
        if bucket.is_last():
            self.iteration += 1
        if iteration < self.start_iter:
            return False
        params = tuple(id(p) for p in bucket.parameters())
        if self.buckets.setdefault(bucket.index(), params) != params:
            raise RuntimeError(
                f"bucket {bucket.index()} now holds other parameters than when its state was kept "
                f"(iteration {iteration}): DistributedDataParallel rebuilt its buckets after its "
                f"first iteration. Start compressing after the rebuild (start_iter >= 1; 2, the "
                f"default, as torch's powerSGD_hook requires start_powerSGD_iter > 1; got "
                f"start_iter={self.start_iter})")
        return True


def done(value):
    """A completed ``torch.futures.Future`` holding ``value`` (what a comm hook returns)."""
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def allreduce_mean(bucket: dist.GradBucket, process_group=None):
    """DDP's own all-reduce, as PyTorch's ``allreduce_hook``: the buffer divided by the number of
    ranks, summed over them; returns a completed future of the buffer."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(process_group))
    dist.all_reduce(buf, group=process_group)
    return done(buf)


SCHEMES = ("int8", "topk", "randomk")


class CompressionState(HookState):
    """What ``compression_hook`` keeps between steps, per bucket of a DDP model.

    Args:
        scheme: ``"int8"``, ``"topk"`` or ``"randomk"``.
        density: float in (0, 1], the fraction of a bucket's entries top-K and random-K send
            (K = ``keep_count(numel, density)``).
        chunk: int ≥ 1, the number of consecutive elements that share one int8 scale.
        error_feedback: keep what was not sent and add it to the next step's gradient.
        seed: int ≥ 0, seeds random-K's indices (the same on every rank).
        process_group: the group to communicate over (None: the default group).
        start_iter: the first iteration (from 0) that compresses (``HookState``; default 2, as
            torch's ``start_powerSGD_iter``: after DDP's bucket rebuild).

    Attributes the hook uses: the arguments, ``error`` (bucket index → flat fp32 tensor of what
    this rank has not sent yet) and ``step`` (bucket index → number of earlier compressing
    calls for that bucket).
    """

    def __init__(self, scheme: str, *, density: float = 0.01, chunk: int = 256,
                 error_feedback: bool = True, seed: int = 0, process_group=None,
                 start_iter: int = 2):
        super().__init__(process_group, start_iter=start_iter)
        one_of("scheme", scheme, SCHEMES)
        density = number("density", density, low=0, high=1, low_open=True)  # the fraction sent
        chunk = positive_int("chunk", chunk)  # elements per int8 scale
        boolean("error_feedback", error_feedback)
        seed = non_negative_int("seed", seed)
        self.scheme, self.density, self.chunk = scheme, density, chunk
        self.error_feedback, self.seed = error_feedback, seed
        self.error: dict[int, torch.Tensor] = {}
        self.step: dict[int, int] = {}


def keep_count(numel: int, density: float) -> int:
    """K, the number of entries top-K and random-K send of a bucket of ``numel`` ≥ 1 elements:
    ⌈density · numel⌉ for a density in (0, 1] (at least 1, at most numel)."""
    numel = positive_int("numel", numel)
    density = number("density", density, low=0, high=1, low_open=True)
    return max(1, min(numel, math.ceil(density * numel)))


def check_k(k, numel: int) -> None:
    """Refuse a K that is not an int in (0, numel], naming ``k``."""
    if not (is_int(k) and 0 < int(k) <= numel):
        raise ValueError(f"k must be an int in (0, numel] = (0, {numel}], got {k!r}")


def random_indices(numel: int, k: int, *, seed: int, bucket: int, step: int) -> torch.Tensor:
    """The K distinct indices random-K sends for bucket ``bucket`` at its call number ``step``.

    The same on every rank (drawn from a generator seeded by ``seed``, ``bucket`` and ``step``
    only), so no rank has to send them. int64, in no particular order.
    """
    numel = positive_int("numel", numel)
    check_k(k, numel)
    for name, value in (("seed", seed), ("bucket", bucket), ("step", step)):
        non_negative_int(name, value)
    g = torch.Generator().manual_seed(seed * 1_000_003 + bucket * 10_007 + step)
    return torch.randperm(numel, generator=g)[:k]


def check_flat(x, name: str = "x") -> None:
    """Refuse anything but a 1-D floating-point tensor, naming ``name``."""
    tensor(name, x, floating=True)
    if x.dim() != 1:
        raise TypeError(f"{name} must be a 1-D floating-point tensor, got shape {tuple(x.shape)}")


def check_compression_state(state) -> None:
    """Refuse a ``state`` that is not a ``CompressionState``."""
    if not isinstance(state, CompressionState):
        raise TypeError(f"state must be a CompressionState, got {type(state).__name__}")


class PowerSGDState(HookState):
    """What PowerSGD keeps between steps, per bucket of a DDP model.

    Args:
        rank: int ≥ 1, the rank r of the approximation (capped at min(n, m) per matrix).
        process_group: the group to all-reduce over (None: the default group).
        seed: int ≥ 0, seeds the random starting Q (the same on every rank).
        start_iter: the first iteration (from 0) that compresses (``HookState``; default 2:
            torch's ``start_powerSGD_iter``, after DDP's bucket rebuild); the iterations before
            it are plain all-reduces.
        orthogonalization_epsilon: ε ≥ 0 added to each column's norm when P and Q are
            orthonormalised (``orthogonalize_``); torch's default, 0, turns a gradient matrix
            that is exactly zero (a layer that got no signal) into NaN, as torch's hook does;
            a small ε (1e-8) keeps it zero.

    Attributes the hook uses: ``rank``, ``process_group``, ``orthogonalization_epsilon``, ``error`` (bucket index → flat tensor
    of the error left by the last step), ``q`` (bucket index → list of the last Q of each
    compressed matrix, for the warm start), ``rng`` (NumPy RandomState; see ``initial_qs``).
    """

    def __init__(self, rank: int, process_group=None, *, seed: int = 0, start_iter: int = 2,
                 orthogonalization_epsilon: float = 0.0):
        rank = positive_int("rank", rank)  # the rank r of the approximation
        seed = non_negative_int("seed", seed)
        self.orthogonalization_epsilon = number("orthogonalization_epsilon",
                                                orthogonalization_epsilon, low=0)
        super().__init__(process_group, start_iter=start_iter)
        self.rank, self.seed = rank, seed
        self.error: dict[int, torch.Tensor] = {}
        self.q: dict[int, list[torch.Tensor]] = {}
        self.rng = np.random.RandomState(seed)


def should_compress(n: int, m: int, r: int) -> bool:
    """True when the factors of an n×m matrix at rank r are smaller than the matrix: (n+m)·r < n·m.

    A vector (m = 1) never is, so biases and norm weights go uncompressed.
    """
    n, m, r = positive_int("n", n), positive_int("m", m), positive_int("r", r)
    return (n + m) * r < n * m


def initial_qs(state: PowerSGDState, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The random starting Q (m×r, fp32, standard normal, not yet orthogonalised) of each matrix.

    ``shapes`` are the (n, m) of the matrices to compress, in bucket order, r = min(n, m, rank).
    Draws exactly as PyTorch's PowerSGD hook does (one seed per call from ``state.rng``, then the
    matrices grouped by shape in order of first appearance), so that both start from the same Q.
    Every rank draws the same numbers.
    """
    check_powersgd_state(state)
    shapes = [tuple(s) for s in shapes]
    for shape in shapes:
        if len(shape) != 2 or not all(isinstance(d, int) and d >= 1 for d in shape):
            raise ValueError(f"shapes must be (n, m) pairs of ints >= 1, got {shape!r}")
    order: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(shapes):
        order.setdefault(tuple(shape), []).append(i)
    qs: list[torch.Tensor | None] = [None] * len(shapes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(state.rng.randint(1_000_000_000))
        for (n, m), idx in order.items():
            r = min(n, m, state.rank)
            for i in idx:
                qs[i] = torch.randn(m, r, dtype=torch.float32)
    return qs


def orthogonalize_(a: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Orthonormalise the columns of the n×r matrix ``a`` in place (Gram–Schmidt); returns ``a``.

    ``a``: a 2-D floating-point tensor; ``eps`` ≥ 0 is added to each column's norm before the
    division (PyTorch's hook uses 0: a zero column then gives NaN, as it does there)."""
    tensor("a", a, floating=True, ndim=2)
    eps = number("eps", eps, low=0)
    for i in range(a.shape[1]):
        col = a[:, i:i + 1]
        col /= torch.linalg.vector_norm(col) + eps
        if i + 1 < a.shape[1]:
            rest = a[:, i + 1:]
            rest -= (col * rest).sum(dim=0, keepdim=True) * col
    return a


def check_powersgd_state(state) -> None:
    """Refuse a ``state`` that is not a ``PowerSGDState``."""
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"state must be a PowerSGDState, got {type(state).__name__}")
