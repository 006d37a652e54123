"""PowerSGD: send a rank-r approximation of each gradient matrix instead of the matrix.

Vogels, Karimireddy and Jaggi (2019, arXiv 1905.13727) compress an n×m gradient matrix M to two
thin factors with one step of power iteration: P = M Q (n×r), all-reduce P, orthogonalise its
columns, Q = Mᵀ P (m×r), all-reduce Q and divide by the number of ranks, and M̂ = P Qᵀ. Each rank
sends (n + m)·r numbers per matrix instead of n·m. Two details make it train as well as plain
all-reduce: *error feedback* (what the approximation left out of this step's gradient, M - M̂, is
added to the next step's) and a *warm start* (the next step starts its power iteration from this
step's Q, so one iteration per step keeps improving the same subspace). Vectors (biases, layer-norm
weights) would not shrink and are all-reduced as they are.

``powersgd_hook(state, bucket)`` has the signature of a ``DistributedDataParallel``
communication hook (``ddp.register_comm_hook(state, powersgd_hook)``), like PyTorch's
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook``. Like it, it keeps
its error and Q per bucket, so it all-reduces plainly until ``state.start_iter`` (PyTorch's
``start_powerSGD_iter``, 2 by default): DDP rebuilds its buckets after the first iteration.
``PowerSGDState``, ``should_compress``, ``initial_qs`` and ``orthogonalize_`` are given
(``labkit.comm_hooks``).

Chapter 4 (book/04_gradients.md); Lab 4, exercise 4.5 (labs/04_gradients.ipynb).
"""
# no `from __future__ import annotations`: DDP's register_comm_hook reads the hook's
# annotations and wants the classes themselves (dist.GradBucket), not strings
import torch
import torch.distributed as dist

from labkit.comm_hooks import (PowerSGDState, allreduce_mean, check_powersgd_state, done,
                               initial_qs, orthogonalize_, should_compress)

__all__ = ["PowerSGDState", "should_compress", "initial_qs", "orthogonalize_", "powersgd_hook"]


# ==== exercise 4.5: your code ====


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: all-reduce the bucket's gradients with PowerSGD.

    Contract (``bucket`` is a ``dist.GradBucket``: ``bucket.buffer()`` the flat fp32 gradients,
    ``bucket.gradients()`` views of it per parameter, ``bucket.index()``):
        * Error feedback: the error this bucket kept from the last step is added to the gradients
          first; afterwards ``state.error[index]`` holds (gradients + old error) − what was
          returned, on this rank.
        * Each gradient viewed as an n×m matrix (first dimension × the rest) with
          r = min(n, m, state.rank) is compressed when ``should_compress(n, m, r)``, otherwise
          (vectors) it is all-reduced as it is and divided by the world size.
        * A compressed matrix M: one power-iteration step from Q (the warm start: this bucket's
          last Q, orthonormalised; on the bucket's first call, ``initial_qs``, orthonormalised);
          P = M Q, all-reduce P (sum), orthonormalise P's columns (``orthogonalize_``; every
          orthonormalisation with ``eps=state.orthogonalization_epsilon``, as torch's hook),
          Q = Mᵀ P, all-reduce Q and divide by the world size, M̂ = P Qᵀ. M̂ replaces M in the
          buffer and Q is kept in ``state.q[index]``.
        * Communication: one all-reduce of the uncompressed gradients, one of all the P's, one of
          all the Q's (each a single flat fp32 tensor): (n + m)·r·4 bytes per compressed matrix.
        * Returns a completed ``torch.futures.Future`` whose value is ``bucket.buffer()`` (``done``).

    The first lines (given) are DDP's plain all-reduce until ``state.start_iter``, as in PyTorch's
    hook: no state is kept before DDP rebuilds its buckets.
    """
    check_powersgd_state(state)
    if not state.compressing(bucket):
        return allreduce_mean(bucket, state.process_group)
    # BEGIN SOLUTION 4.5: error feedback, split compressed/uncompressed, one power-iteration step with the warm-started Q, three all-reduces, new error and Q
    group = state.process_group
    world = dist.get_world_size(group)
    index = bucket.index()
    buf = bucket.buffer()
    if index in state.error:
        buf.add_(state.error[index])
    before = buf.detach().clone()

    mats, plain = [], []
    for g in bucket.gradients():
        mat = g.view(g.shape[0], -1) if g.dim() > 0 else g.view(1, 1)
        n, m = mat.shape
        if should_compress(n, m, min(n, m, state.rank)):
            mats.append(mat)
        else:
            plain.append(g)

    flat = torch.cat([g.reshape(-1) for g in plain]) if plain else buf.new_zeros(0)
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    off = 0
    for g in plain:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()

    if mats:
        if index in state.q:
            qs = state.q[index]
        else:
            qs = initial_qs(state, [tuple(mat.shape) for mat in mats])
        eps = state.orthogonalization_epsilon
        qs = [orthogonalize_(q.clone(), eps) for q in qs]
        ps = [mat @ q for mat, q in zip(mats, qs)]
        p_flat = torch.cat([p.reshape(-1) for p in ps])
        dist.all_reduce(p_flat, group=group)
        off = 0
        for i, p in enumerate(ps):
            ps[i] = orthogonalize_(p_flat[off:off + p.numel()].view_as(p), eps)
            off += p.numel()
        qs = [mat.t() @ p for mat, p in zip(mats, ps)]
        q_flat = torch.cat([q.reshape(-1) for q in qs])
        dist.all_reduce(q_flat, group=group)
        q_flat.div_(world)
        off = 0
        for i, q in enumerate(qs):
            qs[i] = q_flat[off:off + q.numel()].view_as(q)
            off += q.numel()
        for mat, p, q in zip(mats, ps, qs):
            mat.copy_(p @ q.t())
        state.q[index] = qs

    state.error[index] = before - buf
    return done(buf)
    # END SOLUTION
