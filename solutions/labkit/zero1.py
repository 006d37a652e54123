"""ZeRO stage 1: each of N data-parallel ranks keeps the optimizer states of 1/N of the parameters.

In plain data parallelism every rank holds a full copy of Adam's states: 12Ψ bytes in mixed
precision (fp32 master weights, m and v). ZeRO-1 (Rajbhandari et al. 2019, arXiv 1910.02054)
notices that the update is elementwise, so no rank needs the states of parameters it does not
update. All parameters are viewed as one flat vector of Ψ elements, padded to N·S with
S = ceil(Ψ/N), and rank r owns the slice [r·S, (r+1)·S). Each step:

1. backward as usual (full gradients on every rank);
2. all-reduce the flat gradient and divide by N (the average, as DDP does);
3. Adam on the owned slice only, with that slice's states;
4. all-gather the updated slices, so every rank has every updated parameter again.

States per rank: K·S bytes, K = 8 for fp32 parameters (m and v) and K = 12 for 16-bit
parameters (plus the fp32 master slice); per-GPU total in mixed precision 2Ψ + 2Ψ + 12Ψ/N.
The communication is DDP's all-reduce plus one all-gather of the parameters.

``torch.distributed.optim.ZeroRedundancyOptimizer`` does the same with whole parameters: it
gives each rank a set of tensors, which cannot split Ψ evenly; the flat partition here can.

Chapter 2 (book/02_optimizer_states.md); Lab 2, exercise 2.5 (labs/02_optimizer_states.ipynb).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labkit.comm_count import CommCounts, count_comm
from labkit.optimizer_states import state_bytes

# torch 2.13 names it all_gather_single; older releases all_gather_into_tensor (same operator).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def partition(numel: int, world_size: int) -> tuple[int, int]:
    """Split a flat vector of ``numel`` elements evenly over ``world_size`` ranks.

    Returns:
        ``(shard_size, padding)``: S = ceil(numel / N) elements per rank and the N·S − numel
        zeros appended at the end so that every rank's slice has exactly S elements.
    """
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 1:
        raise ValueError(f"numel must be a positive int, got {numel!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    # BEGIN SOLUTION 2.5: S = ceil(numel / world_size) and the padding N·S − numel
    shard_size = math.ceil(numel / world_size)
    return shard_size, shard_size * world_size - numel
    # END SOLUTION


def flatten_padded(tensors, padding: int, dtype: torch.dtype) -> torch.Tensor:
    """Concatenate the tensors, flattened, in order, then ``padding`` zeros; as ``dtype``."""
    pieces = [t.detach().reshape(-1).to(dtype) for t in tensors]
    pieces.append(torch.zeros(padding, dtype=dtype, device=pieces[0].device))
    return torch.cat(pieces)  # (numel + padding,)


def copy_from_flat(flat: torch.Tensor, tensors) -> None:
    """Copy consecutive pieces of ``flat`` into the tensors, in order (padding at the end ignored)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


class ZeRO1Adam:
    """Adam with ZeRO stage 1 over a process group: states for 1/N of a flat parameter vector.

    Every rank builds it with the same parameters (same order, same shapes). ``self.state`` holds
    this rank's slice of the states, each a float32 tensor of ``shard_size`` elements:
    ``"exp_avg"`` and ``"exp_avg_sq"``, plus ``"master"`` (the fp32 copy of the slice) when the
    parameters are 16-bit. State bytes per rank: K·S, K = 8 (fp32 parameters) or 12 (16-bit).

    Args:
        params: the model's parameters; one floating dtype for all.
        lr, betas, eps: as ``torch.optim.Adam`` (no weight decay).
        group: the data-parallel process group (None: the default group).
    """

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, group=None):
        self.params = [p for p in params]
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
        self.lr, self.betas, self.eps, self.group = float(lr), tuple(betas), float(eps), group
        self.dtype = self.params[0].dtype
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size, self.padding = partition(self.numel, self.world_size)
        self.step_count = 0
        self.state: dict[str, torch.Tensor] = {}
        # BEGIN SOLUTION 2.5: fill self.state with this rank's fp32 slices: exp_avg, exp_avg_sq, and master (a copy of the slice) for 16-bit params
        lo, hi = self.rank * self.shard_size, (self.rank + 1) * self.shard_size
        device = self.params[0].device
        self.state["exp_avg"] = torch.zeros(self.shard_size, dtype=torch.float32, device=device)
        self.state["exp_avg_sq"] = torch.zeros(self.shard_size, dtype=torch.float32, device=device)
        if self.dtype != torch.float32:  # 16-bit parameters: keep the fp32 master slice
            self.state["master"] = flatten_padded(self.params, self.padding, torch.float32)[lo:hi].clone()
        # END SOLUTION

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients over the ranks, update this rank's slice with Adam, all-gather.

        1. g = flat fp32 gradient (zeros for a parameter without one), padded to N·S;
           all-reduce it and divide by N;
        2. θ_slice = the fp32 master slice (16-bit parameters) or the slice of the flat fp32
           parameters; Adam on (θ_slice, g_slice) exactly as ``torch.optim.Adam``;
        3. all-gather the updated slices (cast to the parameters' dtype) into a flat vector of
           N·S and copy it back into the parameters.
        """
        # BEGIN SOLUTION 2.5: all-reduce and average the flat gradient, Adam on this rank's slice, all-gather the slices into the parameters
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat_grad = flatten_padded(grads, self.padding, torch.float32)  # (N·S,)
        dist.all_reduce(flat_grad, group=self.group)
        flat_grad /= self.world_size
        lo, hi = self.rank * self.shard_size, (self.rank + 1) * self.shard_size
        g = flat_grad[lo:hi]  # (S,)
        if "master" in self.state:
            shard = self.state["master"]
        else:
            shard = flatten_padded(self.params, self.padding, torch.float32)[lo:hi]
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
        # END SOLUTION

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients (set them to None, or to zero)."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


# ---------------------------------------------------------------- per-rank workers (infrastructure)

def train_data_parallel(rank: int, world_size: int, model: torch.nn.Module, batches, *,
                        optimizer: str = "zero1", lr: float = 1e-3, dtype=None) -> dict:
    """Train ``model`` on this rank's batches with a sharded optimizer; run by ``labkit.dist.launch``.

    Args:
        model: the same initial model on every rank (a GPT: ``model(x, y)`` is the loss).
        batches: ``batches[step][rank]`` is this rank's ``(x, y)`` at that step.
        optimizer: ``"zero1"`` (``ZeRO1Adam``) or ``"zero_redundancy"`` (PyTorch's
            ``ZeroRedundancyOptimizer`` around ``torch.optim.Adam``, whole tensors per rank).
        dtype: cast the model to this dtype first (e.g. torch.bfloat16), None to keep it.

    Returns:
        ``{"params": [tensors], "losses": [floats], "state_bytes": this rank's optimizer
        state bytes, "state": {name: (numel, dtype)}, "numel_owned": parameters this rank updates,
        "comm": {"calls": ..., "bytes_sent": ...} of the optimizer steps}``.
    """
    if optimizer not in ("zero1", "zero_redundancy"):
        raise ValueError(f"optimizer must be 'zero1' or 'zero_redundancy', got {optimizer!r}")
    if dtype is not None:
        model = model.to(dtype)
    params = list(model.parameters())
    if optimizer == "zero1":
        opt = ZeRO1Adam(params, lr=lr)
    else:  # imported here: the import takes seconds (import it in the parent before launching)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=lr)
    losses, comm = [], CommCounts()
    for step_batches in batches:
        x, y = step_batches[rank]
        loss = model(x, y)
        loss.backward()
        with count_comm() as counts:
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        comm.calls.update(counts.calls)
        comm.bytes_sent.update(counts.bytes_sent)
    if optimizer == "zero1":
        owned = min(opt.shard_size, max(0, opt.numel - rank * opt.shard_size))
        shapes = {k: (v.numel(), str(v.dtype)) for k, v in opt.state.items()}
    else:
        local = [p for g in opt.optim.param_groups for p in g["params"]]
        owned = sum(p.numel() for p in local)
        shapes = {}
    return {"params": [p.detach().clone() for p in params], "losses": losses,
            "state_bytes": state_bytes(opt), "state": shapes, "numel_owned": owned,
            "comm": {"calls": dict(comm.calls), "bytes_sent": dict(comm.bytes_sent)}}
