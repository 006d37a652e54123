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

The memory is kept per bucket, and DDP rebuilds its buckets after the first iteration; so, as
PyTorch's ``powerSGD_hook`` does, the hook compresses from ``state.start_iter`` (2 by default)
and is DDP's plain all-reduce before it (given: ``labkit.comm_hooks``).

Chapter 4 (book/04_gradients.md); Lab 4, exercise 4.4 (labs/04_gradients.ipynb).
"""

# no `from __future__ import annotations`: DDP's register_comm_hook reads the hook's
# annotations and wants the classes themselves (dist.GradBucket), not strings
import torch
import torch.distributed as dist

from labkit.comm_hooks import (SCHEMES, CompressionState, allreduce_mean, check_compression_state,
                               check_flat, check_k, done, keep_count, random_indices)
from labkit.validate import positive_int, tensor

__all__ = ["SCHEMES", "CompressionState", "keep_count", "random_indices", "quantize_int8",
           "dequantize_int8", "topk", "compression_hook"]


# ==== exercise 4.4: your code ====


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
    check_flat(x)
    chunk = positive_int("chunk", chunk)
    # BEGIN SOLUTION 4.4: split into chunks; one scale per chunk; round to int8 codes
    n = x.numel()
    whole = n // chunk * chunk  # the full chunks are a (chunks, chunk) view; the short last one apart
    flat = x.detach().float()
    scales = torch.cat([flat[:whole].view(-1, chunk).abs().amax(dim=1),
                        flat[whole:].abs().amax().reshape(1) if whole < n else flat.new_zeros(0)]) / 127
    per_element = scales.masked_fill(scales == 0, 1).repeat_interleave(chunk)[:n]
    codes = (flat / per_element).round_().clamp_(-127, 127).to(torch.int8)
    return codes, scales
    # END SOLUTION


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, chunk: int) -> torch.Tensor:
    """The fp32 values that ``quantize_int8`` codes stand for: each code times its chunk's scale.

    Contract: ``codes`` int8 1-D, ``scales`` fp32 with ⌈numel / chunk⌉ entries (ValueError
    naming ``scales`` otherwise), ``chunk`` an int ≥ 1 (ValueError naming ``chunk``). Returns a
    new fp32 tensor of the codes' numel.
    """
    tensor("codes", codes, ndim=1)
    if codes.dtype != torch.int8:
        raise TypeError(f"codes must be an int8 tensor, got {codes.dtype}")
    tensor("scales", scales, floating=True, ndim=1)
    chunk = positive_int("chunk", chunk)
    if scales.numel() != -(-codes.numel() // chunk):
        raise ValueError(f"scales must have ceil(numel / chunk) = {-(-codes.numel() // chunk)} "
                         f"entries, got {scales.numel()}")
    # BEGIN SOLUTION 4.4: multiply each code by its chunk's scale
    n = codes.numel()
    whole = n // chunk * chunk  # full chunks as a (chunks, chunk) view, the short last one apart
    out = codes.float()  # one pass to fp32, then one in-place multiply: no padded copies
    out[:whole].view(-1, chunk).mul_(scales[:whole // chunk, None].float())
    out[whole:].mul_(scales[whole // chunk:].float())
    return out
    # END SOLUTION


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K entries of a flat tensor largest in magnitude.

    Contract: ``x`` 1-D floating point (TypeError otherwise); ``k`` an int in (0, x.numel()]
    (ValueError naming ``k`` otherwise), checked before any work. Returns ``(values, indices)``:
    the K values (x's dtype, signs kept) and their int64 indices into x, in any order.
    """
    check_flat(x)
    check_k(k, x.numel())
    # BEGIN SOLUTION 4.4: find the K largest magnitudes; return their values and indices
    idx = x.detach().abs().topk(k, sorted=False).indices
    return x.detach()[idx], idx
    # END SOLUTION


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
        * ``state.step[index]`` counts the calls for this bucket (those that compress).
        * Returns a completed ``torch.futures.Future`` whose value is ``bucket.buffer()`` (``done``).

    The first lines (given) are DDP's plain all-reduce until ``state.start_iter``, so that no
    state is kept before DDP rebuilds its buckets.
    """
    check_compression_state(state)
    if not state.compressing(bucket):
        return allreduce_mean(bucket, state.process_group)
    # BEGIN SOLUTION 4.4: add the kept error; compress by scheme; send; rebuild and average every rank's part; keep the new error
    group = state.process_group
    world = dist.get_world_size(group)
    index = bucket.index()
    buf = bucket.buffer()
    if state.error_feedback and index in state.error:
        g = buf.detach().float() + state.error[index]
    else:
        g = buf.detach().float().clone()
    n = g.numel()
    step = state.step.get(index, 0)
    if state.scheme == "int8":
        codes, scales = quantize_int8(g, state.chunk)
        c = scales.numel()
        payload = torch.cat([scales.view(torch.int8), codes])
        gathered = payload.new_empty(world * payload.numel())
        dist.all_gather_single(gathered, payload, group=group)
        parts = [dequantize_int8(piece[4 * c:], piece[:4 * c].clone().view(torch.float32), state.chunk)
                 for piece in gathered.view(world, -1)]
        sent = parts[dist.get_rank(group)]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
    else:
        k = keep_count(n, state.density)
        if state.scheme == "topk":
            values, idx = topk(g, k)
        else:
            idx = random_indices(n, k, seed=state.seed, bucket=index, step=step).to(g.device)
            values = g[idx]
        sent = torch.zeros_like(g)
        sent[idx] = values
        total = torch.zeros_like(g)
        if state.scheme == "topk":
            all_values = values.new_empty(world * k)
            all_idx = torch.empty(world * k, dtype=torch.int32, device=g.device)
            dist.all_gather_single(all_values, values.contiguous(), group=group)
            dist.all_gather_single(all_idx, idx.to(torch.int32), group=group)
            total.index_add_(0, all_idx.long(), all_values)
        else:
            summed = values.clone()
            dist.all_reduce(summed, group=group)
            total[idx] = summed
    state.step[index] = step + 1
    if state.error_feedback:
        state.error[index] = g.sub_(sent)
    buf.copy_(total.div_(world))
    return done(buf)
    # END SOLUTION
