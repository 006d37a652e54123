"""ZeRO stage 1: each of N data-parallel ranks keeps the optimizer states of 1/N of the parameters.

In plain data parallelism every rank holds a full copy of Adam's states: 12Ψ bytes in mixed
precision (fp32 master weights, m and v). ZeRO-1 (Rajbhandari et al. 2019, arXiv 1910.02054)
notices that the update is elementwise, so no rank needs the states of parameters it does not
update. The trainable parameters are viewed as one flat vector of Ψ elements, padded to N·S
with S = ceil(Ψ/N) (``labkit.flat_params``), and rank r owns the slice [r·S, (r+1)·S). A step:

1. backward as usual (full gradients on every rank);
2. **reduce-scatter** the flat gradient: rank r receives only the sum of its slice, and divides
   it by N (the average, as DDP takes);
3. the wrapped optimizer (any ``torch.optim`` class, with the model's parameter groups) updates
   this rank's slice only, with that slice's states;
4. **all-gather** the updated slices, so every rank has every updated parameter again.

Communication: a reduce-scatter and an all-gather each put (N−1)/N · Ψ elements on the wire per
rank, 2Ψ in all — the same volume as the all-reduce of plain data parallelism (which *is* a
reduce-scatter followed by an all-gather). ZeRO-1 therefore costs no extra communication.
States per rank: K·S bytes, K = 8 for Adam on fp32 parameters (m and v) and K = 12 on 16-bit
parameters (plus the fp32 master slice); per GPU in mixed precision 2Ψ + 2Ψ + 12Ψ/N.

``torch.distributed.optim.ZeroRedundancyOptimizer`` shards whole tensors instead (each rank
gets a set of parameters, which cannot split Ψ evenly) and broadcasts the updated tensors; the
flat partition here gives every rank the same share.

Chapter 2 (book/02_optimizer_states.md); Lab 2, exercise 2.5 (labs/02_optimizer_states.ipynb).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.comm_count import CommCounts, count_comm
from labkit.flat_params import copy_from_flat, flatten_padded, partition, shard_range
from labkit.optimizer_states import state_bytes

# torch 2.13 names them *_single; older releases *_tensor / *_into_tensor (same operators).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["ZeRO1", "train_data_parallel", "partition"]


def _param_groups(params) -> list[dict]:
    """``params`` as torch.optim takes it (tensors, or dicts with "params") → a list of group dicts."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or of dicts, got a single tensor")
    items = list(params)
    if not items:
        raise ValueError("params must be a non-empty iterable of parameters or parameter groups")
    if all(isinstance(i, dict) for i in items):
        groups = []
        for i, g in enumerate(items):
            if "params" not in g:
                raise ValueError(f"parameter group {i} has no 'params' key")
            ps = g["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            groups.append({**g, "params": ps})
        return groups
    if all(isinstance(i, torch.Tensor) for i in items):
        return [{"params": items}]
    raise TypeError("params must contain only tensors or only dicts (parameter groups), got "
                    f"{sorted({type(i).__name__ for i in items})}")


class ZeRO1:
    """Any ``torch.optim`` optimizer sharded ZeRO-1 style over a process group.

    Every rank builds it with the same parameters (same order, shapes and groups). Parameters
    with ``requires_grad=False`` are frozen: outside the flat vector, never updated, no state.
    The trainable ones of all groups, in order, form one flat vector of Ψ elements padded to
    N·S (S = ceil(Ψ/N)); group g occupies ``self.group_ranges[g]`` of it (the last group also
    takes the padding). This rank owns ``self.shard``, the fp32 values of its slice
    ``[rank·S, (rank+1)·S)``, and ``self.optim = optimizer_class(...)`` holds one parameter per
    group: ``self.pieces[g] = self.shard[a:b]`` with ``(a, b) = self.piece_ranges[g]``, the
    part of group g inside this slice (possibly empty), with that group's options. So the
    wrapped optimizer's states cover exactly S elements.

    Args:
        params: tensors, or parameter groups (dicts with "params" and per-group options such as
            ``lr`` or ``weight_decay``), as for ``torch.optim``; trainable ones share one
            floating dtype and device.
        optimizer_class: a ``torch.optim.Optimizer`` subclass (default ``torch.optim.Adam``).
        group: the data-parallel process group (None: the default group).
        **defaults: options for ``optimizer_class`` (``lr=...``, ``betas=...``, ...).

    ``self.master`` is the fp32 slice when the parameters are 16-bit (counted as optimizer
    state by ``labkit.optimizer_states.state_bytes``), None for fp32 parameters, whose fp32
    slice ``self.shard`` is a working copy of parameters the model already holds.
    """

    def __init__(self, params, optimizer_class=torch.optim.Adam, *, group=None, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError("optimizer_class must be a torch.optim.Optimizer subclass (e.g. "
                            f"torch.optim.Adam), got {optimizer_class!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("ZeRO1 needs an initialised process group (run it inside "
                             "labkit.dist.launch)")
        groups = _param_groups(params)
        seen: set[int] = set()
        self.groups: list[dict] = []
        for g in groups:  # trainable parameters only, each once (a tied weight is one parameter)
            trainable = []
            for p in g["params"]:
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"params must be tensors, got {type(p).__name__}")
                if id(p) in seen:
                    raise ValueError("a parameter appears in more than one parameter group")
                seen.add(id(p))
                if p.requires_grad:
                    trainable.append(p)
            self.groups.append({**g, "params": trainable})
        self.params = [p for g in self.groups for p in g["params"]]
        if not self.params:
            raise ValueError("params has no trainable parameter (all have requires_grad=False)")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or not self.params[0].is_floating_point():
            raise ValueError(f"trainable params must share one floating dtype, got {sorted(map(str, dtypes))}")
        if len({p.device for p in self.params}) != 1:
            raise ValueError("trainable params must be on one device")
        self.group = group
        self.dtype = self.params[0].dtype
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size, self.padding = partition(self.numel, self.world_size)
        lo = self.rank * self.shard_size
        hi = lo + self.shard_size
        self.group_ranges, self.piece_ranges, start = [], [], 0
        for i, g in enumerate(self.groups):
            end = start + sum(p.numel() for p in g["params"])
            if i == len(self.groups) - 1:
                end = self.world_size * self.shard_size  # the padding joins the last group
            self.group_ranges.append((start, end))
            a = min(max(start, lo), hi) - lo
            b = max(min(end, hi), lo) - lo
            self.piece_ranges.append((a, max(a, b)))
            start = end
        flat = flatten_padded(self.params, self.padding, torch.float32)  # (N·S,)
        self.shard = flat[shard_range(self.rank, self.shard_size)].clone()  # (S,) fp32
        self.master = self.shard if self.dtype != torch.float32 else None
        self.pieces = [self.shard[a:b] for a, b in self.piece_ranges]
        local_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [piece]}
                        for g, piece in zip(self.groups, self.pieces)]
        self.optim = optimizer_class(local_groups, **defaults)
        self.param_groups = self.optim.param_groups  # per-group lr etc., e.g. for schedulers

    @property
    def state(self):
        """The wrapped optimizer's states (of this rank's pieces)."""
        return self.optim.state

    @torch.no_grad()
    def step(self) -> None:
        """One data-parallel step of the sharded optimizer; every rank calls it after backward.

        Guarantees, on every rank: the parameters equal what ``optimizer_class`` (same groups and
        options) gives on the gradients averaged over the ranks, unsharded, to rounding (fp32
        parameters; 16-bit ones are the rounded fp32 master, which the step updates); only
        this rank's pieces' states exist and change; a parameter without ``.grad`` counts as a
        zero gradient; frozen parameters are untouched. Communication: exactly one
        reduce-scatter and one all-gather of the padded flat vector, in the parameters' dtype
        (the same volume as DDP's one all-reduce); no all-reduce.
        """
        raise NotImplementedError("exercise 2.5: reduce-scatter the flat gradients and average them, give the pieces their gradients, step, all-gather the slices into the parameters (labs/02_optimizer_states.ipynb)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients of the trainable parameters (set them to None, or to zero)."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for piece in self.pieces:
            piece.grad = None

    def shard_state(self) -> dict[str, torch.Tensor]:
        """This rank's states as flat (S,) tensors, one per state name holding a tensor of the
        piece's shape (e.g. ``exp_avg``): the pieces' states concatenated in order."""
        names = sorted({k for piece in self.pieces for k, v in self.optim.state.get(piece, {}).items()
                        if isinstance(v, torch.Tensor) and v.shape == piece.shape and v.dim() > 0})
        out = {}
        for name in names:
            parts = [self.optim.state[piece][name] if piece in self.optim.state
                     else torch.zeros_like(piece) for piece in self.pieces]
            out[name] = torch.cat([t.reshape(-1) for t in parts])
        return out


# ---------------------------------------------------------------- per-rank workers (infrastructure)

_OPTIMIZERS = ("zero1", "zero_redundancy", "ddp")


def _named_groups(model, groups, frozen):
    names = dict(model.named_parameters())
    for name in frozen:
        if name not in names:
            raise ValueError(f"frozen names an unknown parameter {name!r}; known: {sorted(names)}")
        names[name].requires_grad_(False)
    if groups is None:
        return [p for p in model.parameters()]
    out, used = [], set()
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"groups[{i}] must be a dict with 'params' (parameter names)")
        for name in g["params"]:
            if name not in names:
                raise ValueError(f"groups[{i}] names an unknown parameter {name!r}")
        used.update(g["params"])
        out.append({**g, "params": [names[n] for n in g["params"]]})
    rest = [p for n, p in model.named_parameters() if n not in used]
    if rest:
        out.append({"params": rest})
    return out


def train_data_parallel(rank: int, world_size: int, model: torch.nn.Module, batches, *,
                        optimizer: str = "zero1", optimizer_class=torch.optim.Adam,
                        lr: float = 1e-3, dtype=None, groups=None, frozen=(), **options) -> dict:
    """Train ``model`` on this rank's batches, data-parallel; run by ``labkit.dist.launch``.

    Args:
        model: the same initial model on every rank (a GPT: ``model(x, y)`` is the loss).
        batches: ``batches[step][rank]`` is this rank's ``(x, y)`` at that step.
        optimizer: ``"zero1"`` (``ZeRO1`` around ``optimizer_class``), ``"zero_redundancy"``
            (PyTorch's ``ZeroRedundancyOptimizer`` around ``optimizer_class``, whole tensors per
            rank, gradients all-reduced and averaged first) or ``"ddp"`` (``DistributedDataParallel``
            + ``optimizer_class``, unsharded: the reference).
        optimizer_class: a ``torch.optim.Optimizer`` subclass; ``lr`` and ``**options`` go to it.
        dtype: a floating ``torch.dtype`` to cast the model to first (e.g. torch.bfloat16), or None.
        groups: parameter groups by name, e.g. ``[{"params": ["wte.weight"], "lr": 1e-2}]``; the
            parameters not named form a last group with the defaults. None: one group.
        frozen: names of parameters to freeze (``requires_grad=False``).

    Returns:
        ``{"params": [tensors], "losses": [floats], "state_bytes": this rank's optimizer
        state bytes, "state": {name: (numel, dtype)}, "shard_state": {name: (S,) tensor} (zero1),
        "numel_owned": parameters this rank updates, "comm": {"calls", "bytes_sent",
        "ring_bytes"} of the steps (backward + optimizer step)}``.
    """
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {optimizer!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr < 0:
        raise ValueError(f"lr must be a number >= 0, got {lr!r}")
    batches = list(batches)
    for s, step_batches in enumerate(batches):
        if len(step_batches) < world_size:
            raise ValueError(f"batches[{s}] has {len(step_batches)} entries, need one per rank "
                             f"({world_size})")
    if dtype is not None:
        model = model.to(dtype)
    params = _named_groups(model, groups, frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    runner = model
    if optimizer == "zero1":
        opt = ZeRO1(params, optimizer_class, lr=lr, **options)
    elif optimizer == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        runner = DistributedDataParallel(model)
        opt = optimizer_class(params, lr=lr, **options)
    else:  # imported here: the import takes seconds (import it in the parent before launching)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if groups is not None:
            raise ValueError("groups: ZeroRedundancyOptimizer takes one group here (use zero1 or ddp)")
        opt = ZeroRedundancyOptimizer([p for p in params if p.requires_grad],
                                      optimizer_class=optimizer_class, lr=lr, **options)
    losses, comm = [], CommCounts()
    for step_batches in batches:
        x, y = step_batches[rank]
        with count_comm() as counts:
            loss = runner(x, y)
            loss.backward()
            if optimizer == "zero_redundancy":  # average the gradients, as DDP does
                for p in trainable:
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad.div_(world_size)
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        for name in ("calls", "bytes_sent", "ring_bytes"):
            getattr(comm, name).update(getattr(counts, name))
    result = {"params": [p.detach().clone() for p in model.parameters()], "losses": losses,
              "state_bytes": state_bytes(opt), "shard_state": {}}
    if optimizer == "zero1":
        owned = min(opt.shard_size, max(0, opt.numel - rank * opt.shard_size))
        result["shard_state"] = {k: v.clone() for k, v in opt.shard_state().items()}
        result["shard_size"] = opt.shard_size
    elif optimizer == "ddp":
        owned = sum(p.numel() for p in trainable)
    else:
        local = [p for g in opt.optim.param_groups for p in g["params"]]
        owned = sum(p.numel() for p in local)
    inner = opt.optim if optimizer != "ddp" else opt
    shapes: dict = {}
    for s in inner.state.values():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                n, _ = shapes.get(k, (0, None))
                shapes[k] = (n + v.numel(), str(v.dtype))
    if optimizer == "zero1" and opt.master is not None:
        shapes["master"] = (opt.master.numel(), str(opt.master.dtype))
    result.update(state=shapes, numel_owned=owned,
                  comm={"calls": dict(comm.calls), "bytes_sent": dict(comm.bytes_sent),
                        "ring_bytes": dict(comm.ring_bytes)})
    return result
