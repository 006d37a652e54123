"""ZeRO stage 2: each of N data-parallel ranks keeps 1/N of the gradients (and of Adam's states).

ZeRO-1 (lab 2) shards the optimizer states but still all-reduces a full gradient into every
rank: 2Ψ bytes of 16-bit gradients (4Ψ in fp32) per rank at the end of backward. Yet a rank
only updates its own slice of the flat parameter vector, so it only needs the reduced gradient
of that slice. ZeRO-2 (Rajbhandari et al. 2019, arXiv 1910.02054) therefore replaces the
all-reduce by a reduce-scatter, and does it during backward: gradients are grouped into buckets
in the order they become ready; when a bucket is full, one reduce-scatter sends each rank the
sum of the pieces it owns, and the full gradients of the bucket are freed at once. A rank then
holds its gradient shard (S = ceil(Ψ/N) elements), the bucket that is filling, and what is in
flight; never the whole gradient. After backward: Adam on the owned slice (as ZeRO-1), then one
all-gather of the updated slices. Per GPU in mixed precision: 2Ψ + (2 + 12)Ψ/N bytes.

Communication: reduce-scatter Ψ + all-gather Ψ elements per step, what one all-reduce (DDP)
costs — the gradient memory is saved for free.

The flat layout is ``labkit.flat_params``: parameter i occupies ``[offset_i, offset_i + n_i)`` of
a vector padded to N·S; rank r owns ``[r·S, (r+1)·S)``. A bucket's parameters need not be
contiguous, so a bucket is reduced with ``dist.reduce_scatter(output, input_list)``: input i
holds, concatenated in bucket order, the pieces of the bucket's gradients that rank i owns
(possibly none; the sizes differ between ranks, which gloo and NCCL accept).

Chapter 4 (book/04_gradients.md); Lab 4, exercise 4.3 (labs/04_gradients.ipynb).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from labkit.comm_count import CommCounts, count_comm
from labkit.flat_params import copy_from_flat, flatten_padded, partition, shard_range

# torch 2.13 names it all_gather_single; older releases all_gather_into_tensor (same operator).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def owned_pieces(offset: int, numel: int, shard_size: int, world_size: int):
    """Where a parameter at ``[offset, offset + numel)`` of the flat vector meets each shard.

    Returns a list of ``(rank, start_in_param, start_in_shard, length)``, one per rank whose
    slice ``[rank·S, (rank+1)·S)`` overlaps the parameter, in rank order.
    """
    pieces = []
    for rank in range(world_size):
        lo = max(offset, rank * shard_size)
        hi = min(offset + numel, (rank + 1) * shard_size)
        if hi > lo:
            pieces.append((rank, lo - offset, lo - rank * shard_size, hi - lo))
    return pieces


class ZeRO2Adam:
    """Adam with ZeRO stage 2 over a process group: 1/N of the gradients and states per rank.

    Every rank builds it with the same parameters (same order, same shapes) *before* backward:
    the constructor registers a post-accumulate-grad hook on every parameter. During backward the
    hooks fill a bucket, in the order the gradients become ready, with gradients of up to
    ``bucket_cap_bytes`` (fp32 bytes, 4 per element); a bucket that reaches the cap is
    reduce-scattered at once (``async_op=True``) and the full gradients in it are set to None.
    ``step()`` sends the last, partial bucket, waits for every reduce-scatter, averages over the
    ranks, runs Adam (exactly ``torch.optim.Adam``, no weight decay) on this rank's slice and
    all-gathers the updated parameters. Several backward passes before one ``step()`` add up,
    as ``.grad`` would.

    Attributes a grader reads:
        grad_shard: float32 (S,) — the sum over ranks of this rank's slice of the gradient, as
            received so far (zeros after ``step()``).
        state: ``"exp_avg"``, ``"exp_avg_sq"`` (float32, S each) and ``"master"`` (fp32 slice)
            for 16-bit parameters.
        offsets: the flat offset of each parameter.

    Args:
        params: the model's parameters; one floating dtype for all.
        lr, betas, eps: as ``torch.optim.Adam``.
        bucket_cap_bytes: int > 0, fp32 bytes of gradients per bucket.
        group: the data-parallel process group (None: the default group).
    """

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, bucket_cap_bytes: int = 25 * 2**20, group=None):
        self.params = list(params)
        if not self.params:
            raise ValueError("params must be a non-empty iterable of parameters")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or not self.params[0].is_floating_point():
            raise ValueError(f"params must share one floating dtype, got {sorted(map(str, dtypes))}")
        if not (isinstance(lr, (int, float)) and lr >= 0):
            raise ValueError(f"lr must be a number >= 0, got {lr!r}")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be a pair of numbers in [0, 1), got {betas!r}")
        if not isinstance(bucket_cap_bytes, int) or isinstance(bucket_cap_bytes, bool) \
                or bucket_cap_bytes <= 0:
            raise ValueError(f"bucket_cap_bytes must be an int > 0, got {bucket_cap_bytes!r}")
        self.lr, self.betas, self.eps, self.group = float(lr), tuple(betas), float(eps), group
        self.bucket_cap_bytes = bucket_cap_bytes
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
        self.in_flight: list[tuple] = []  # (work, output buffer, [(start_in_shard, length)])
        self.handles = []
        # BEGIN SOLUTION 4.3: register self._on_grad_ready on every parameter (keep the handles)
        for p in self.params:
            self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        # END SOLUTION

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Called by autograd once ``param.grad`` is complete: add it to the bucket; send the
        bucket (``self._send_bucket()``) as soon as it holds ``bucket_cap_bytes`` or more."""
        # BEGIN SOLUTION 4.3: add param to the bucket and send the bucket once it reaches the cap
        self.bucket.append(param)
        self.bucket_bytes += 4 * param.numel()
        if self.bucket_bytes >= self.bucket_cap_bytes:
            self._send_bucket()
        # END SOLUTION

    def _send_bucket(self) -> None:
        """Start one asynchronous reduce-scatter of the bucket's gradients (fp32): rank i
        receives the sum over ranks of the pieces it owns, in bucket order; remember the work,
        the output buffer and where its pieces go in ``grad_shard``; set the bucket's ``.grad``
        to None and empty the bucket. A parameter without a gradient counts as zeros. Nothing
        to do for an empty bucket."""
        # BEGIN SOLUTION 4.3: one async reduce-scatter of the bucket's pieces per owner rank, remember where they land, free the full gradients
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
        self.in_flight.append((work, output, mine))
        for p in self.bucket:
            p.grad = None
        self.bucket, self.bucket_bytes = [], 0
        # END SOLUTION

    @torch.no_grad()
    def step(self) -> None:
        """Send the last bucket; wait for all reduce-scatters and add their outputs into
        ``grad_shard``; average over the ranks; Adam on this rank's slice; all-gather the
        updated slices (in the parameters' dtype) into the parameters; zero ``grad_shard``."""
        # BEGIN SOLUTION 4.3: flush and wait, average the shard, Adam on the slice, all-gather the parameters, reset the shard
        self._send_bucket()
        for work, output, mine in self.in_flight:
            work.wait()
            offset = 0
            for shard_start, length in mine:
                self.grad_shard[shard_start:shard_start + length] += output[offset:offset + length]
                offset += length
        self.in_flight = []
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
        _all_gather_flat(gathered, shard.to(self.dtype), group=self.group)
        copy_from_flat(gathered, self.params)
        self.grad_shard.zero_()
        # END SOLUTION

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget any full gradient still held (the reduced shard is reset by ``step()``)."""
        for p in self.params:
            p.grad = None

    def remove(self) -> None:
        """Unregister the hooks."""
        for h in self.handles:
            h.remove()
        self.handles = []


# ---------------------------------------------------------------- per-rank worker (infrastructure)

def live_grad_bytes(params) -> int:
    """Bytes of the ``.grad`` tensors that exist right now (each storage once)."""
    seen = {}
    for p in params:
        if p.grad is not None:
            st = p.grad.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def train_zero2(rank: int, world_size: int, model: torch.nn.Module, batches, *, lr: float = 1e-3,
                bucket_cap_bytes: int = 25 * 2**20, reference: bool = True,
                probe: bool = True) -> dict:
    """Train a copy of ``model`` with ``ZeRO2Adam`` on this rank's batches; with ``reference``,
    train another copy with ``DistributedDataParallel`` + ``torch.optim.Adam`` side by side.

    ``batches[step][rank]`` is this rank's ``(x, y)``. A probe hook, registered after the
    optimizer's, records the ``.grad`` bytes alive after every gradient-ready event.

    Returns ``{"params", "ref_params", "losses", "ref_losses", "comm": {"calls", "bytes_sent"}
    of one step (backward + step) each, "peak_grad_bytes": most .grad bytes alive during the
    ZeRO-2 backward passes, "ref_peak_grad_bytes": the same for DDP, "shard_bytes",
    "largest_grad_bytes", "timeline": [(event, live .grad bytes)] of the first backward}``.
    """
    zmodel = copy.deepcopy(model)
    params = list(zmodel.parameters())
    opt = ZeRO2Adam(params, lr=lr, bucket_cap_bytes=bucket_cap_bytes)
    peak, timeline = [0], []

    def record(_p, peak=peak, params=params, timeline=timeline):
        b = live_grad_bytes(params)
        peak[0] = max(peak[0], b)
        timeline.append(b)

    if probe:
        for p in params:
            p.register_post_accumulate_grad_hook(record)
    losses, comm_steps = [], []
    for i, step_batches in enumerate(batches):
        x, y = step_batches[rank]
        with count_comm() as counts:
            loss = zmodel(x, y)
            loss.backward()
            opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        comm_steps.append({"calls": dict(counts.calls), "bytes_sent": dict(counts.bytes_sent)})
        if i == 0:
            first_timeline = list(timeline)
    out = {"params": [p.detach().clone() for p in params], "losses": losses,
           "comm": comm_steps, "peak_grad_bytes": peak[0],
           "shard_bytes": opt.grad_shard.numel() * opt.grad_shard.element_size(),
           "largest_grad_bytes": max(4 * p.numel() for p in params),
           "timeline": first_timeline if probe else []}
    if reference:
        from torch.nn.parallel import DistributedDataParallel

        rmodel = copy.deepcopy(model)
        ddp = DistributedDataParallel(rmodel)
        ropt = torch.optim.Adam(rmodel.parameters(), lr=lr)
        rparams = list(rmodel.parameters())
        rpeak, rtimeline = [0], []

        def rrecord(_p):
            b = live_grad_bytes(rparams)
            rpeak[0] = max(rpeak[0], b)
            rtimeline.append(b)

        for p in rparams:
            p.register_post_accumulate_grad_hook(rrecord)
        ref_losses = []
        for i, step_batches in enumerate(batches):
            x, y = step_batches[rank]
            loss = ddp(x, y)
            loss.backward()
            if i == 0:
                first_rtimeline = list(rtimeline)
            rpeak[0] = max(rpeak[0], live_grad_bytes(rparams))  # DDP writes grads after hooks too
            ropt.step()
            ropt.zero_grad(set_to_none=True)
            ref_losses.append(float(loss.detach()))
        out.update(ref_params=[p.detach().clone() for p in rparams], ref_losses=ref_losses,
                   ref_peak_grad_bytes=rpeak[0], ref_timeline=first_rtimeline)
    return out
