"""ZeRO stage 3 (Rajbhandari et al. 2019, arXiv 1910.02054) / FSDP (Zhao et al. 2023, arXiv
2304.11277): shard the parameters too.

ZeRO-1 (chapter 2) shards the optimizer states, ZeRO-2 the gradients as well; ZeRO-3 also keeps
only 1/N of the parameters on each rank. The model is cut into *units* (here: each transformer
block, plus the *root* unit of the remaining parameters: embeddings, final LayerNorm, head). Each
unit's parameters are one flat vector, padded to N·S elements (S = ceil(Ψ_unit/N)); rank r keeps
the slice [r·S, (r+1)·S) (``labkit.flat_params``). Per step:

1. before a unit's forward, **all-gather** its full parameters; after it, free them;
2. before the unit's backward, all-gather them **again**; after it, free them;
3. **reduce-scatter** the unit's gradients: rank r receives the sum of slice r; divide by N;
4. Adam on the owned slices only (states 1/N too).

Persistent parameter bytes per rank: Σ_units ceil(Ψ_unit/N) × 4 (fp32); at any moment one block
(and the root, which is used at both ends of the step and stays gathered from the start of
forward to the end of backward) is materialized on top. Communication per step: 2 all-gathers
and 1 reduce-scatter of each block's Ψ_unit (3Ψ in all, 1.5× data parallelism's 2Ψ of one
all-reduce); the root is gathered once. With ``prefetch=True`` the all-gather of the unit that
runs next is issued before this one computes (asynchronously), so the transfer can overlap the
compute; the peak then holds one more block. PyTorch's FSDP2 (``fully_shard``) does the same
(``labkit.reference.lab3.train_fsdp2`` runs it for comparison). Frozen parameters
(``requires_grad=False``) are sharded and gathered like the others and receive no update.
Lab 3, exercise 3.7; chapter 3 (book/03_parameters.md).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from labkit.flat_params import flatten_padded, partition, shard_range
from labkit.validate import adam_args, boolean

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["Unit", "ZeRO3"]


# ==== given: the course's code — read it, call it, don't change it ====
class Unit:
    """One unit's bookkeeping on this rank.

    Attributes:
        module: the module whose forward brackets the unit (the model itself for the root).
        params: the unit's parameters, in order; their ``.data`` are views into ``full``.
        numel, shard_size, padding: Ψ_unit, S = ceil(Ψ_unit/N), N·S − Ψ_unit.
        full: the padded flat fp32 buffer of N·S elements; its storage is resized to 0 bytes
            while the unit is freed.
        shard: this rank's fp32 slice of the parameters (S elements), persistent.
        grad: this rank's averaged fp32 gradient slice after backward (None before).
        exp_avg, exp_avg_sq: Adam's states for the slice.
    """

    def __init__(self, module: nn.Module, params: list[nn.Parameter]):
        self.module, self.params = module, params
        self.numel = sum(p.numel() for p in params)
        self.trainable = sum(p.requires_grad for p in params)  # gradients to wait for
        self.shard_size = self.padding = 0
        self.full = self.shard = self.grad = self.exp_avg = self.exp_avg_sq = None
        self.grads_ready = 0
        self.pending = None  # the handle of a prefetch all-gather still in flight


class ZeRO3:
    """ZeRO-3 on ``model`` over a process group: units ``model.h[i]`` and the root.

    Build it on every rank with the same model (same initial weights); it installs hooks, so
    ``loss = model(x, y); loss.backward(); zero3.step()`` trains with sharded parameters.

    Args:
        model: a ``labkit.models.GPT`` (anything with a ModuleList ``h`` of blocks).
        lr, betas, eps: as ``torch.optim.Adam`` (no weight decay).
        group: the process group (None: the default group).
        prefetch: start the all-gather of the block that runs next before this block computes.

    Attributes:
        units: the blocks' units, then the root's.
        peak_live_bytes: the most bytes of gathered (full) parameter buffers, measured from
            their storages after every gather the hooks trigger.
        events: what happened, in order: ("all_gather", unit index, asynchronous?) when an
            all-gather is issued (under :meth:`log_all_gathers`), ("forward_end", i),
            ("backward_start", i), ("backward_end", i) for block i.
    """

    # ==== given: the course's code — read it, call it, don't change it ====
    def __init__(self, model: nn.Module, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 group=None, prefetch: bool = False):
        boolean("prefetch", prefetch)
        adam_args(lr=lr, betas=betas, eps=eps)
        if not isinstance(getattr(model, "h", None), nn.ModuleList) or len(model.h) == 0:
            raise ValueError("model must have a non-empty ModuleList 'h' of blocks (a labkit GPT)")
        bad = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if bad:  # the shards, the full buffers and Adam are fp32: a 16-bit model would silently change dtype
            raise ValueError(f"model's parameters must be float32 (ZeRO3 keeps fp32 shards), got dtypes {bad}")
        self.model, self.lr, self.betas, self.eps, self.group = model, float(lr), tuple(betas), eps, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.step_count = 0
        self.peak_live_bytes = 0
        self.prefetch, self.events = prefetch, []
        in_blocks = {id(p) for b in model.h for p in b.parameters()}
        self.units = [Unit(b, list(b.parameters())) for b in model.h]
        self.units.append(Unit(model, [p for p in model.parameters() if id(p) not in in_blocks]))
        for u in self.units:
            self._shard(u)
        for u in self.units[:-1]:
            self._install_block_hooks(u)
        self._install_root_hooks(self.units[-1])

    # ==== exercise 3.7: your code ====
    def _shard(self, u: Unit) -> None:
        """Set up unit ``u``: S and padding; ``u.shard`` = a copy of this rank's slice of the
        padded flat fp32 parameters; ``u.full`` = an N·S buffer whose pieces become the
        parameters' ``.data`` (views, in order); Adam states zeros of S; then free ``u``."""
        # BEGIN SOLUTION 3.7: partition, keep this rank's slice as the shard, make the params views into one padded full buffer, free it
        u.shard_size, u.padding = partition(u.numel, self.world_size)
        flat = flatten_padded(u.params, u.padding, torch.float32)
        u.shard = flat[shard_range(self.rank, u.shard_size)].clone()
        u.exp_avg, u.exp_avg_sq = torch.zeros_like(u.shard), torch.zeros_like(u.shard)
        u.full = torch.zeros(self.world_size * u.shard_size, dtype=torch.float32)
        offset = 0
        for p in u.params:
            p.data = u.full[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        self._free(u)
        # END SOLUTION

    def _gather(self, u: Unit) -> None:
        """Materialize unit ``u``: give ``u.full`` its storage back and all-gather every rank's
        shard into it (one all-gather of N·S elements), without bumping its version counter
        (autograd saved views of it in forward). Nothing to do if it is already gathered; if a
        prefetch of ``u`` is in flight (``u.pending``), wait for it instead."""
        # BEGIN SOLUTION 3.7: resize the storage back, all-gather the shards into it (version counter preserved)
        if u.pending is not None:
            u.pending.wait()
            u.pending = None
            return
        nbytes = u.full.numel() * u.full.element_size()
        if u.full.untyped_storage().nbytes() == nbytes:
            return  # already gathered
        u.full.untyped_storage().resize_(nbytes)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(u.full):
            _all_gather_flat(u.full, u.shard, group=self.group)
        # END SOLUTION

    def _prefetch(self, u: Unit) -> None:
        """Start materializing unit ``u`` without waiting: its storage back and the all-gather of
        the shards issued asynchronously (version counter preserved), its handle kept in
        ``u.pending`` for :meth:`_gather` to wait on. Nothing to do if ``u`` is already gathered
        or in flight."""
        # BEGIN SOLUTION 3.7: like _gather, but the collective is asynchronous and its handle kept
        nbytes = u.full.numel() * u.full.element_size()
        if u.pending is not None or u.full.untyped_storage().nbytes() == nbytes:
            return
        u.full.untyped_storage().resize_(nbytes)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(u.full):
            u.pending = _all_gather_flat(u.full, u.shard, group=self.group, async_op=True)
        # END SOLUTION

    def _free(self, u: Unit) -> None:
        """Release the full parameters of ``u``: resize ``u.full``'s storage to 0 bytes."""
        # BEGIN SOLUTION 3.7: resize the full buffer's storage to 0 bytes
        u.full.untyped_storage().resize_(0)
        # END SOLUTION

    def _reduce_scatter_grads(self, u: Unit) -> None:
        """After the last gradient of ``u`` arrives: reduce-scatter the padded flat fp32 gradient
        (one reduce-scatter of N·S elements; a frozen parameter, which has no gradient,
        contributes zeros), ``u.grad`` = this rank's slice / N (added to an existing ``u.grad``:
        several backwards before one step accumulate); drop the full gradients (``p.grad =
        None``) and free ``u``."""
        # BEGIN SOLUTION 3.7: flatten and pad the grads, reduce-scatter, average into u.grad, drop full grads, free the unit
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in u.params]
        flat = flatten_padded(grads, u.padding, torch.float32)
        mine = torch.empty(u.shard_size, dtype=torch.float32)
        _reduce_scatter_flat(mine, flat, group=self.group)
        mine /= self.world_size
        u.grad = mine if u.grad is None else u.grad + mine
        for p in u.params:
            p.grad = None
        self._free(u)
        # END SOLUTION

    @torch.no_grad()
    def step(self) -> None:
        """Adam (as ``torch.optim.Adam``) on every unit's shard with its averaged gradient slice;
        then forget the gradient slices. The full parameters are refreshed by the next gather."""
        self.step_count += 1
        # BEGIN SOLUTION 3.7: Adam with bias correction on each shard, then clear the shard gradients
        beta1, beta2 = self.betas
        t = self.step_count
        for u in self.units:
            if u.grad is None:
                continue
            u.exp_avg.lerp_(u.grad, 1 - beta1)
            u.exp_avg_sq.mul_(beta2).addcmul_(u.grad, u.grad, value=1 - beta2)
            denom = (u.exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** t)).add_(self.eps)
            u.shard.addcdiv_(u.exp_avg, denom, value=-self.lr / (1 - beta1 ** t))
            u.grad = None
        # END SOLUTION

    # ==== given: the course's code — read it, call it, don't change it ====
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget any full gradient still held (the slices are consumed by ``step()``), as an
        optimizer's ``zero_grad``; lets ZeRO-3 stand where a ``torch.optim`` optimizer does."""
        for p in self.model.parameters():
            p.grad = None

    def _gather_and_measure(self, u: Unit, then: Unit | None = None) -> None:
        """Gather ``u``; with prefetch on, start gathering ``then`` (the unit that runs next)."""
        self._gather(u)
        if self.prefetch and then is not None:
            self._prefetch(then)
        live = sum(v.full.untyped_storage().nbytes() for v in self.units)
        self.peak_live_bytes = max(self.peak_live_bytes, live)

    def _on_grad(self, u: Unit) -> None:
        u.grads_ready += 1
        if u.grads_ready == u.trainable:
            u.grads_ready = 0
            if u is not self.units[-1]:
                self.events.append(("backward_end", self.units.index(u)))
            self._reduce_scatter_grads(u)

    def _install_grad_hooks(self, u: Unit) -> None:
        for p in u.params:
            if p.requires_grad:  # a frozen parameter gets no gradient (and takes no hook)
                p.register_post_accumulate_grad_hook(lambda p, u=u: self._on_grad(u))

    def _install_block_hooks(self, u: Unit) -> None:
        i = self.units.index(u)
        blocks = len(self.units) - 1
        after = self.units[i + 1] if i + 1 < blocks else None  # next in forward
        before = self.units[i - 1] if i > 0 else None  # next in backward

        def pre_forward(module, args):
            self._gather_and_measure(u, then=after)

        def pre_backward(grad):
            self._gather_and_measure(u, then=before)
            self.events.append(("backward_start", i))

        def post_forward(module, args, out):
            self.events.append(("forward_end", i))
            self._free(u)
            if out.requires_grad:  # before this block's backward: gather it again
                out.register_hook(pre_backward)

        u.module.register_forward_pre_hook(pre_forward)
        u.module.register_forward_hook(post_forward)
        self._install_grad_hooks(u)

    def _install_root_hooks(self, u: Unit) -> None:
        first = self.units[0]  # the first block runs right after the root's embeddings
        u.module.register_forward_pre_hook(lambda module, args: self._gather_and_measure(u, then=first))
        self._install_grad_hooks(u)

    def log_all_gathers(self):
        """A context manager that appends ("all_gather", unit index, asynchronous?) to ``events``
        whenever an all-gather into a unit's buffer is issued on this thread (a dispatch mode: it
        sees the call when it is made, not when it completes)."""
        from torch.utils._python_dispatch import TorchDispatchMode

        zero3 = self

        class _Log(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if "allgather" in func.__name__:
                    ptr = args[0].data_ptr() if isinstance(args[0], torch.Tensor) else None
                    for k, v in enumerate(zero3.units):
                        if v.full.untyped_storage().nbytes() and v.full.data_ptr() == ptr:
                            is_async = bool(args[3]) if len(args) > 3 else True
                            zero3.events.append(("all_gather", k, is_async))
                return func(*args, **(kwargs or {}))

        return _Log()

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter of the model, gathered (for checking; one all-gather per unit)."""
        out = {}
        for u in self.units:
            self._gather(u)
            for p in u.params:
                out[id(p)] = p.detach().clone()
            self._free(u)
        return [out[id(p)] for p in self.model.parameters()]

    def shard_bytes(self) -> int:
        """Persistent parameter bytes of this rank: the shards."""
        return sum(u.shard.numel() * u.shard.element_size() for u in self.units)


