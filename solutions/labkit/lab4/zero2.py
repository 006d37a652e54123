"""ZeRO stage 2: each of N data-parallel ranks keeps 1/N of the gradients (and of Adam's states).

ZeRO-1 (lab 2) shards the optimizer states but still all-reduces a full gradient into every
rank: 2Ψ bytes of 16-bit gradients (4Ψ in fp32) per rank at the end of backward. Yet a rank
only updates its own slice of the flat parameter vector, so it only needs the reduced gradient
of that slice. ZeRO-2 (Rajbhandari et al. 2019, arXiv 1910.02054) therefore replaces the
all-reduce by a reduce-scatter, and does it during backward: gradients are grouped into buckets
in the order they become ready; when a bucket is full, one reduce-scatter sends each rank the
sum of the pieces it owns, and the full gradients of the bucket are freed at once. When the next
bucket is sent, the previous reduce-scatter (which had a whole bucket of backward to finish) is
waited for and its output added into the rank's gradient shard, so at most one is in flight. A
rank then holds its gradient shard (S = ceil(Ψ/N) elements, 4Ψ/N bytes in fp32), the bucket that
is filling and the one in flight; never the whole gradient. After backward: Adam on the owned
slice (as ZeRO-1), then one all-gather of the updated slices. Per GPU in mixed precision:
2Ψ + (2 + 12)Ψ/N bytes.

Communication: reduce-scatter Ψ + all-gather Ψ elements per step, what one all-reduce (DDP)
costs — the gradient memory is saved for free.

The flat layout is ``labkit.flat_params`` over the trainable parameters (frozen ones, with
``requires_grad=False``, are outside it and never updated, as ``torch.optim.Adam`` skips them):
parameter i occupies ``[offset_i, offset_i + n_i)`` of a vector padded to N·S; rank r owns
``[r·S, (r+1)·S)``. A bucket's parameters need not be contiguous, so a bucket is reduced with
``dist.reduce_scatter(output, input_list)``: input i holds, concatenated in bucket order, the
pieces of the bucket's gradients that rank i owns (possibly none; the sizes differ between
ranks, which gloo and NCCL accept).

Chapter 4 (book/04_gradients.md); Lab 4, exercise 4.3 (labs/04_gradients.ipynb).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labkit.flat_params import copy_from_flat, flatten_padded, partition, shard_range
from labkit.validate import adam_args, non_negative_int, params as check_params, positive_int

# ==== given: the course's code — read it, call it, don't change it ====


def owned_pieces(offset: int, numel: int, shard_size: int, world_size: int):
    """Where a parameter at ``[offset, offset + numel)`` of the flat vector meets each shard.

    Returns a list of ``(rank, start_in_param, start_in_shard, length)``, one per rank whose
    slice ``[rank·S, (rank+1)·S)`` overlaps the parameter, in rank order.
    """
    offset, numel = non_negative_int("offset", offset), non_negative_int("numel", numel)
    shard_size = positive_int("shard_size", shard_size)
    world_size = positive_int("world_size", world_size)
    pieces = []
    for rank in range(world_size):
        lo = max(offset, rank * shard_size)
        hi = min(offset + numel, (rank + 1) * shard_size)
        if hi > lo:
            pieces.append((rank, lo - offset, lo - rank * shard_size, hi - lo))
    return pieces


def _trainable(params) -> list[torch.Tensor]:
    """The distinct parameters that require a gradient, in order (refusing what is not one)."""
    items = check_params("params", params)
    if any(isinstance(p, dict) for p in items):
        raise TypeError("params: ZeRO2Adam takes one list of parameters, not param groups "
                        "(dicts); every parameter shares lr, betas and eps")
    seen, out = set(), []
    for p in items:
        if id(p) not in seen:  # a tied weight listed twice is one parameter
            seen.add(id(p))
            if p.requires_grad:
                out.append(p)
    if not out:
        raise ValueError("params has no trainable parameter (all have requires_grad=False)")
    dtypes = {p.dtype for p in out}
    if len(dtypes) != 1 or not out[0].is_floating_point():
        raise ValueError(f"trainable params must share one floating dtype, got {sorted(map(str, dtypes))}")
    if len({p.device for p in out}) != 1:
        raise ValueError("trainable params must be on one device")
    return out


class ZeRO2Adam:
    """Adam with ZeRO stage 2 over a process group: 1/N of the gradients and states per rank.

    Every rank builds it with the same parameters (same order, same shapes) *before* backward:
    the constructor registers a post-accumulate-grad hook on every trainable parameter. During
    backward the hooks fill a bucket, in the order the gradients become ready, with gradients of
    up to ``bucket_cap_bytes`` (fp32 bytes, 4 per element); a bucket that reaches the cap is
    reduce-scattered at once (``async_op=True``), the full gradients in it are set to None, and
    the previous bucket's reduce-scatter is waited for and its output added into ``grad_shard``
    (at most one in flight). ``step()`` sends the last, partial bucket, waits for the one in
    flight, averages over the ranks, runs Adam (exactly ``torch.optim.Adam``, no weight decay) on
    this rank's slice and all-gathers the updated parameters. Several backward passes before one
    ``step()`` add up, as ``.grad`` would, for any bucket size.

    Memory after backward: ``grad_shard`` (4Ψ/N bytes) + the bucket that is filling + the one
    in flight (its fp32 input and this rank's output).

    Attributes a grader reads:
        grad_shard: float32 (S,) — the sum over ranks of this rank's slice of the gradient, as
            received so far (zeros after ``step()``).
        state: ``"exp_avg"``, ``"exp_avg_sq"`` (float32, S each) and ``"master"`` (fp32 slice)
            for 16-bit parameters.
        offsets: the flat offset of each trainable parameter (``self.params``).

    Args:
        params: the model's parameters (a list; frozen ones are skipped); one floating dtype
            and one device for the trainable ones.
        lr, betas, eps: as ``torch.optim.Adam`` (refused where it refuses them).
        bucket_cap_bytes: int > 0, fp32 bytes of gradients per bucket.
        group: the data-parallel process group (None: the default group).
    """

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, bucket_cap_bytes: int = 25 * 2**20, group=None):
        self.params = _trainable(params)
        adam_args(lr=lr, betas=betas, eps=eps)
        self.bucket_cap_bytes = positive_int("bucket_cap_bytes", bucket_cap_bytes)
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("ZeRO2Adam needs an initialised process group (run it inside "
                             "labkit.ranks.launch)")
        self.lr, self.betas, self.eps, self.group = float(lr), tuple(betas), float(eps), group
        self.dtype = self.params[0].dtype
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size, self.padding = partition(self.numel, self.world_size)
        self.offsets, offset = [], 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.index = {p: i for i, p in enumerate(self.params)}  # parameter -> position
        device = self.params[0].device
        self.grad_shard = torch.zeros(self.shard_size, dtype=torch.float32, device=device)
        self.state: dict[str, torch.Tensor] = {
            "exp_avg": torch.zeros(self.shard_size, dtype=torch.float32, device=device),
            "exp_avg_sq": torch.zeros(self.shard_size, dtype=torch.float32, device=device),
        }
        if self.dtype != torch.float32:  # 16-bit parameters: keep the fp32 master slice
            flat = flatten_padded(self.params, self.padding, torch.float32)
            self.state["master"] = flat[shard_range(self.rank, self.shard_size)].clone()
        self.step_count = 0
        self.bucket: list[torch.nn.Parameter] = []  # parameters whose gradient waits in the bucket
        self.bucket_bytes = 0
        self.in_flight = None  # (work, output buffer, [(start_in_shard, length)]) or None
        self.handles = []
        self._register_hooks()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard every gradient since the last ``step()``: the full ``.grad`` still held, the
        bucket, the reduce-scatter in flight (waited for, so every rank's collectives still
        match) and ``grad_shard``."""
        self._finish_in_flight()
        self.bucket, self.bucket_bytes = [], 0
        self.grad_shard.zero_()
        for p in self.params:
            p.grad = None

    def remove(self) -> None:
        """Unregister the hooks."""
        for h in self.handles:
            h.remove()
        self.handles = []

    # ==== exercise 4.3: your code ====

    def _register_hooks(self) -> None:
        """Register ``self._on_grad_ready`` as a post-accumulate-grad hook on every parameter of
        ``self.params``; keep the handles in ``self.handles``."""
        # BEGIN SOLUTION 4.3: register self._on_grad_ready on every trainable parameter (keep the handles)
        for p in self.params:
            self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        # END SOLUTION

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Called by autograd once ``param.grad`` is complete: add it to the bucket; send the
        bucket (``self._send_bucket()``) as soon as it holds ``bucket_cap_bytes`` or more.

        A second backward before ``step()`` calls this again for a parameter that may still wait
        in the bucket: its ``.grad`` already holds the sum, and the bucket must send it once."""
        # BEGIN SOLUTION 4.3: add param to the bucket unless it already waits there; send the bucket once it reaches the cap
        if any(p is param for p in self.bucket):
            return  # a later backward added into the .grad that the bucket will send
        self.bucket.append(param)
        self.bucket_bytes += 4 * param.numel()
        if self.bucket_bytes >= self.bucket_cap_bytes:
            self._send_bucket()
        # END SOLUTION

    def _send_bucket(self) -> None:
        """Start one asynchronous reduce-scatter of the bucket's gradients (fp32): rank i
        receives the sum over ranks of the pieces it owns, in bucket order; set the bucket's
        ``.grad`` to None and empty the bucket; then finish the reduce-scatter sent before
        (``self._finish_in_flight()``) and keep the new one (its work, output buffer and where
        its pieces go in ``grad_shard``) in ``self.in_flight``. A parameter without a gradient
        counts as zeros. Nothing to do for an empty bucket."""
        # BEGIN SOLUTION 4.3: one async reduce-scatter of the bucket's pieces per owner rank, free the full gradients, finish the previous one, keep this one in flight
        if not self.bucket:
            return
        inputs = [[] for _ in range(self.world_size)]
        mine = []
        for p in self.bucket:
            i = self.index[p]
            g = p.grad.detach().reshape(-1).float() if p.grad is not None \
                else torch.zeros(p.numel(), dtype=torch.float32, device=self.grad_shard.device)
            for rank, start, shard_start, length in owned_pieces(
                    self.offsets[i], p.numel(), self.shard_size, self.world_size):
                inputs[rank].append(g[start:start + length])
                if rank == self.rank:
                    mine.append((shard_start, length))
        empty = self.grad_shard.new_zeros(0)
        inputs = [torch.cat(pieces) if pieces else empty for pieces in inputs]
        output = torch.empty_like(inputs[self.rank])
        work = dist.reduce_scatter(output, inputs, group=self.group, async_op=True)
        for p in self.bucket:
            p.grad = None
        self.bucket, self.bucket_bytes = [], 0
        self._finish_in_flight()
        self.in_flight = (work, output, mine)
        # END SOLUTION

    def _finish_in_flight(self) -> None:
        """Wait for the reduce-scatter in flight, if any, add its output into ``grad_shard`` at
        the places it stands for, and forget it (``self.in_flight = None``)."""
        # BEGIN SOLUTION 4.3: wait for the one in flight and add its pieces into grad_shard
        if self.in_flight is None:
            return
        work, output, mine = self.in_flight
        work.wait()
        offset = 0
        for shard_start, length in mine:
            self.grad_shard[shard_start:shard_start + length] += output[offset:offset + length]
            offset += length
        self.in_flight = None
        # END SOLUTION

    @torch.no_grad()
    def step(self) -> None:
        """Send the last bucket and finish the reduce-scatter in flight; average ``grad_shard``
        over the ranks; Adam on this rank's slice; all-gather the updated slices (in the
        parameters' dtype) into the parameters; zero ``grad_shard``."""
        # BEGIN SOLUTION 4.3: flush and finish, average the shard, Adam on the slice, all-gather the parameters, reset the shard
        self._send_bucket()
        self._finish_in_flight()
        g = self.grad_shard / self.world_size
        if "master" in self.state:
            shard = self.state["master"]
        else:
            shard = flatten_padded(self.params, self.padding, torch.float32)[
                shard_range(self.rank, self.shard_size)]
        beta1, beta2 = self.betas
        self.step_count += 1
        t = self.step_count
        m, v = self.state["exp_avg"], self.state["exp_avg_sq"]
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(self.eps)
        shard.addcdiv_(m, denom, value=-self.lr / (1 - beta1 ** t))
        gathered = torch.empty(self.world_size * self.shard_size, dtype=self.dtype,
                               device=shard.device)  # (N·S,)
        dist.all_gather_single(gathered, shard.to(self.dtype), group=self.group)
        copy_from_flat(gathered, self.params)
        self.grad_shard.zero_()
        # END SOLUTION
