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
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook``.

Chapter 4 (book/04_gradients.md); Lab 4, exercise 4.5 (labs/04_gradients.ipynb).
"""
import numpy as np
import torch
import torch.distributed as dist

from labkit.validate import non_negative_int, number, positive_int, tensor

# ==== given: the course's code — read it, call it, don't change it ====


class PowerSGDState:
    """What PowerSGD keeps between steps, per bucket of a DDP model.

    Args:
        rank: int ≥ 1, the rank r of the approximation (capped at min(n, m) per matrix).
        process_group: the group to all-reduce over (None: the default group).
        seed: int ≥ 0, seeds the random starting Q (the same on every rank).

    Attributes the hook uses: ``rank``, ``process_group``, ``error`` (bucket index → flat tensor
    of the error left by the last step), ``q`` (bucket index → list of the last Q of each
    compressed matrix, for the warm start), ``rng`` (NumPy RandomState; see ``initial_qs``).
    """

    def __init__(self, rank: int, process_group=None, *, seed: int = 0):
        rank = positive_int("rank", rank)  # the rank r of the approximation
        seed = non_negative_int("seed", seed)
        self.rank, self.process_group, self.seed = rank, process_group, seed
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
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"state must be a PowerSGDState, got {type(state).__name__}")
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


def _done(value):
    """A completed ``torch.futures.Future`` holding ``value`` (what a comm hook returns)."""
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def _check_state(state) -> None:
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"state must be a PowerSGDState, got {type(state).__name__}")


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
          P = M Q, all-reduce P (sum), orthonormalise P's columns (``orthogonalize_``),
          Q = Mᵀ P, all-reduce Q and divide by the world size, M̂ = P Qᵀ. M̂ replaces M in the
          buffer and Q is kept in ``state.q[index]``.
        * Communication: one all-reduce of the uncompressed gradients, one of all the P's, one of
          all the Q's (each a single flat fp32 tensor): (n + m)·r·4 bytes per compressed matrix.
        * Returns a completed ``torch.futures.Future`` whose value is ``bucket.buffer()``.
    """
    _check_state(state)
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
        qs = [orthogonalize_(q.clone()) for q in qs]
        ps = [mat @ q for mat, q in zip(mats, qs)]
        p_flat = torch.cat([p.reshape(-1) for p in ps])
        dist.all_reduce(p_flat, group=group)
        off = 0
        for i, p in enumerate(ps):
            ps[i] = orthogonalize_(p_flat[off:off + p.numel()].view_as(p))
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
    return _done(buf)
    # END SOLUTION
