"""Gradient compression with error feedback: int8, top-K and random-K as DDP communication hooks.

Data parallelism sends every gradient every step. Three ways to send fewer bytes, each used by
``compression_hook(state, bucket)``, a ``DistributedDataParallel`` communication hook
(``ddp.register_comm_hook(state, compression_hook)``, like PyTorch's ``allreduce_hook`` and
``fp16_compress_hook`` in ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``):

* **int8** with one fp32 scale per chunk of consecutive elements (1 byte per element instead
  of 4, plus 4 bytes per chunk). The ranks' codes have different scales and 8 bits would
  overflow in a sum, so they cannot be all-reduced: every rank all-gathers all ranks' codes
  and scales and decodes them.
* **top-K**: the K entries largest in magnitude, as fp32 values and int32 indices. Each rank
  picks different indices, so again an all-gather.
* **random-K**: K entries at random indices that every rank draws from the same seed, so the
  indices need not be sent and the K values can be all-reduced.

Whatever a rank did not send this step is kept in an **error-feedback** memory and added to its
next gradient (Seide et al. 2014, 1-bit SGD; Stich et al. 2018, arXiv 1809.07599; Karimireddy
et al. 2019, arXiv 1901.09847): nothing is lost, only delayed.

Chapter 4 (book/04_gradients.md); Lab 4, exercise 4.4 (labs/04_gradients.ipynb).
"""

import copy
import math

import torch
import torch.distributed as dist

SCHEMES = ("int8", "topk", "randomk")


class CompressionState:
    """What ``compression_hook`` keeps between steps, per bucket of a DDP model.

    Args:
        scheme: ``"int8"``, ``"topk"`` or ``"randomk"``.
        density: float in (0, 1], the fraction of a bucket's entries top-K and random-K send
            (K = ``keep_count(numel, density)``).
        chunk: int ≥ 1, the number of consecutive elements that share one int8 scale.
        error_feedback: keep what was not sent and add it to the next step's gradient.
        seed: int, seeds random-K's indices (the same on every rank).
        process_group: the group to communicate over (None: the default group).

    Attributes the hook uses: the arguments, ``error`` (bucket index → flat fp32 tensor of what
    this rank has not sent yet) and ``step`` (bucket index → number of earlier calls for that
    bucket).
    """

    def __init__(self, scheme: str, *, density: float = 0.01, chunk: int = 256,
                 error_feedback: bool = True, seed: int = 0, process_group=None):
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"density must be a number in (0, 1] (the fraction of entries sent), got {density!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1 (elements per int8 scale), got {chunk!r}")
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {type(error_feedback).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.scheme, self.density, self.chunk = scheme, float(density), chunk
        self.error_feedback, self.seed, self.process_group = error_feedback, seed, process_group
        self.error: dict[int, torch.Tensor] = {}
        self.step: dict[int, int] = {}


def keep_count(numel: int, density: float) -> int:
    """K, the number of entries top-K and random-K send of a bucket of ``numel``: ⌈density · numel⌉."""
    return max(1, min(numel, math.ceil(density * numel)))


def _check_k(k, numel: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= numel:
        raise ValueError(f"k must be an int in (0, numel] = (0, {numel}], got {k!r}")


def random_indices(numel: int, k: int, *, seed: int, bucket: int, step: int) -> torch.Tensor:
    """The K distinct indices random-K sends for bucket ``bucket`` at its call number ``step``.

    The same on every rank (drawn from a generator seeded by ``seed``, ``bucket`` and ``step``
    only), so no rank has to send them. int64, in no particular order.
    """
    _check_k(k, numel)
    g = torch.Generator().manual_seed(seed * 1_000_003 + bucket * 10_007 + step)
    return torch.randperm(numel, generator=g)[:k]


def _check_flat(x, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.is_floating_point():
        raise TypeError(f"{name} must be a 1-D floating-point tensor, got "
                        f"{type(x).__name__ if not isinstance(x, torch.Tensor) else f'{x.dtype} of shape {tuple(x.shape)}'}")


def quantize_int8(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat tensor to int8 codes with one fp32 scale per chunk of ``chunk`` elements.

    Contract:
        * ``x`` is 1-D floating point (TypeError otherwise); ``chunk`` an int ≥ 1 (ValueError
          naming ``chunk`` otherwise), checked before any work.
        * Chunk c holds elements [c·chunk, (c+1)·chunk) (the last may be shorter); there are
          ⌈numel / chunk⌉ chunks.
        * Its scale s_c (fp32) = (largest |x| in the chunk) / 127; its codes are x / s_c rounded
          to the nearest integer (``torch.round``: halves to even), so they lie in [-127, 127].
          A chunk of zeros has scale 0 and codes 0.
        * Returns ``(codes, scales)``: int8 of x's numel, fp32 of ⌈numel / chunk⌉.
    """
    _check_flat(x)
    raise NotImplementedError("exercise 4.4: check chunk; split into chunks; one scale per chunk; round to int8 codes (labs/04_gradients.ipynb)")


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, chunk: int) -> torch.Tensor:
    """The fp32 values that ``quantize_int8`` codes stand for: each code times its chunk's scale.

    Contract: ``codes`` int8 1-D, ``scales`` fp32 with ⌈numel / chunk⌉ entries (ValueError
    naming ``scales`` otherwise), ``chunk`` an int ≥ 1 (ValueError naming ``chunk``). Returns a
    new fp32 tensor of the codes' numel.
    """
    raise NotImplementedError("exercise 4.4: check chunk and the number of scales; multiply each code by its chunk's scale (labs/04_gradients.ipynb)")


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K entries of a flat tensor largest in magnitude.

    Contract: ``x`` 1-D floating point (TypeError otherwise); ``k`` an int in (0, x.numel()]
    (ValueError naming ``k`` otherwise), checked before any work. Returns ``(values, indices)``:
    the K values (x's dtype, signs kept) and their int64 indices into x, in any order.
    """
    _check_flat(x)
    raise NotImplementedError("exercise 4.4: check k; find the K largest magnitudes; return their values and indices (labs/04_gradients.ipynb)")


def _done(value):
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: average the bucket's gradients over the ranks, compressed.

    Contract (``bucket.buffer()`` is the flat fp32 buffer of this rank's gradients, not yet
    averaged; ``bucket.index()`` names the bucket; N = ranks in ``state.process_group``):
        * g = the buffer, plus ``state.error[index]`` when ``state.error_feedback`` and this
          bucket has one. What this rank *sends*, ĝ, depends on ``state.scheme``:
          - ``"int8"``: ĝ = ``dequantize_int8(*quantize_int8(g, chunk), chunk)``. Sends all of
            its codes and scales to every rank (all-gather): N·(numel + 4·⌈numel/chunk⌉) bytes
            as ``count_comm`` counts an all-gather (the gathered output).
          - ``"topk"``: ĝ = g at the K = ``keep_count(numel, state.density)`` entries of
            ``topk(g, K)``, 0 elsewhere. Sends the K values (fp32) and the K indices as int32 to
            every rank (all-gather): N·8K bytes.
          - ``"randomk"``: ĝ = g at the K indices of ``random_indices(numel, K, seed=state.seed,
            bucket=index, step=<this bucket's number of earlier calls>)``, 0 elsewhere (no
            rescaling). Every rank draws the same indices, so only the K fp32 values are summed
            (one all-reduce): 4K bytes.
        * The buffer becomes the mean over the ranks of their ĝ (each rank rebuilds every rank's
          ĝ from what it received); the same on every rank.
        * With error feedback, afterwards ``state.error[index]`` = g − ĝ (this rank's own ĝ:
          exactly what it did not send); without, ``state.error`` stays empty.
        * ``state.step[index]`` counts the calls for this bucket.
        * Returns a completed ``torch.futures.Future`` whose value is ``bucket.buffer()``.
    """
    raise NotImplementedError("exercise 4.4: add the kept error; compress by scheme; send; rebuild and average every rank's part; keep the new error (labs/04_gradients.ipynb)")


# ------------------------------------------------------------------ workers (labkit.dist.launch)

def _recording_hook(rec, bucket):
    """Run ``compression_hook`` and log its input buffer, output, kept error and communication."""
    from labkit.comm_count import count_comm

    state, log = rec
    before = bucket.buffer().detach().clone()
    with count_comm() as counts:
        fut = compression_hook(state, bucket)

    def record(f):
        out = f.value()
        out = out[0] if isinstance(out, (list, tuple)) else out
        err = state.error.get(bucket.index())
        log.append({"bucket": bucket.index(), "input": before, "output": out.detach().clone(),
                    "error": None if err is None else err.detach().clone(),
                    "bytes": dict(counts.bytes_sent), "calls": dict(counts.calls)})
        return out

    return fut.then(record)


def _settle_buckets(ddp, loss_fn) -> None:
    """One backward without a hook and without an update: DDP reorders its buckets after its
    first backward (in the order the gradients became ready), which would shuffle the entries
    under a kept error. The parameters do not change."""
    loss_fn().backward()
    ddp.zero_grad(set_to_none=True)


def hook_worker(rank: int, world_size: int, model, batches, configs: dict):
    """Worker: per entry of ``configs`` (label → ``CompressionState`` keyword arguments), a DDP
    of a copy of ``model`` (one bucket) with ``compression_hook``; returns {label: log}.

    ``batches[s][rank]`` is this rank's (x, y) at step s; the loss is the mean squared error of
    ``model(x)`` and ``y``; no update between steps (only the gradients matter). One log entry
    per call of the hook: the buffer before it (``input``), the buffer it returned
    (``output``), ``state.error`` of the bucket after it (``error``, or None) and the bytes and
    calls per collective that ``labkit.comm_count.count_comm`` counted during the call.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for label, kwargs in configs.items():
        ddp = DDP(copy.deepcopy(model), bucket_cap_mb=1024)
        x0, y0 = batches[0][rank]
        _settle_buckets(ddp, lambda: torch.nn.functional.mse_loss(ddp(x0), y0))
        log: list[dict] = []
        ddp.register_comm_hook((CompressionState(**kwargs), log), _recording_hook)
        for step in batches:
            x, y = step[rank]
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            ddp.zero_grad(set_to_none=True)
        out[label] = log
    return out


def train_worker(rank: int, world_size: int, model, batches, runs: dict, *, lr: float,
                 eval_batch=None):
    """Worker: train copies of the course's GPT with DDP + SGD, one per entry of ``runs``.

    ``runs`` maps a label to None (DDP's own uncompressed all-reduce) or to the keyword
    arguments of a ``CompressionState``. ``batches[s][rank]`` is this rank's (x, y) at step s,
    the same for every run; every run starts from ``model`` (the same on every rank). Returns,
    per label: ``losses`` (the mean over the ranks of the training loss, per step),
    ``eval`` (the loss on ``eval_batch`` after training, or None), ``bytes`` and ``ring_bytes``
    (what this rank sent in the last step, per collective, as ``count_comm`` counts them: the
    payload, and what a ring algorithm puts on the wire).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.comm_count import count_comm

    out = {}
    for label, kwargs in runs.items():
        ddp = DDP(copy.deepcopy(model), bucket_cap_mb=1024)
        _settle_buckets(ddp, lambda: ddp(*batches[0][rank]))
        if kwargs is not None:
            ddp.register_comm_hook(CompressionState(**kwargs), compression_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
        losses, sent = [], None
        for step in batches:
            x, y = step[rank]
            with count_comm() as counts:
                loss = ddp(x, y)
                loss.backward()
            sent = dict(counts.bytes_sent), dict(counts.ring_bytes)
            opt.step()
            opt.zero_grad(set_to_none=True)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world_size)
        final = None
        if eval_batch is not None:
            with torch.no_grad():
                final = float(ddp.module(*eval_batch))
        out[label] = {"losses": losses, "eval": final, "bytes": sent[0], "ring_bytes": sent[1]}
    return out
