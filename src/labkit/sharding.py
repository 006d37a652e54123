"""Sharded optimizer states that keep ``torch.optim``'s per-parameter semantics.

ZeRO gives each of N ranks the slice ``[r·S, (r+1)·S)`` of the trainable parameters viewed as
one padded flat vector (``labkit.flat_params``). A slice cuts through parameters, but
``torch.optim`` decides per *parameter*: a parameter without a gradient is skipped and its step
count does not advance (its bias correction counts its own steps), and each parameter group
has its own options. So a rank's slice is cut again at parameter boundaries into *pieces*
(parameter ∩ slice), each a view of the rank's master shard, and the wrapped optimizer gets
one tensor per piece, grouped as the parameters were: it then skips, counts and configures
each piece exactly as it would the whole parameter.

Whether a parameter has a gradient is decided over the whole group of ranks, as
``DistributedDataParallel(find_unused_parameters=True)`` decides it: a parameter used on some
ranks only gets the average with zeros from the others; one used on none is left alone (its
``.grad`` stays None under DDP, so Adam skips it). The ranks learn it without a collective of
its own: every rank's chunk of a reduce-scatter carries, after its S gradient elements, one
*presence* count per parameter (1 where this rank has a gradient), which the reduction sums.

* :class:`ShardLayout`: offsets, S, padding, each rank's pieces, and the reduce-scatter input
  with presence counts (:meth:`ShardLayout.pack`, :meth:`ShardLayout.unpack`).
* :func:`bind_flat_states`: make the wrapped optimizer's per-piece states views of flat (S,)
  tensors, so the shard's states stay one buffer each (what ZeRO-2 and ZeRO-3 report).
* :class:`ShardedOptimizer`: the given half of ZeRO-1 and ZeRO-2 — parameter groups, layout,
  master shard, pieces, the wrapped optimizer, ``zero_grad``, ``state_dict``;
  :class:`BucketedShardedAdam` adds ZeRO-2's gradient shard, presence counts, flat Adam states
  and fixed buckets.

The dtype rule (``labkit.flat_params.master_dtype``) is the same for every stage: the shard and
the states are fp32 for fp32 and 16-bit parameters, fp64 for fp64 ones.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit import validate
from labkit.buckets import BucketSchedule
from labkit.flat_params import flatten_padded, master_dtype, partition, shard_range
from labkit.optim_base import param_groups, refuse_unfrozen

__all__ = ["Piece", "ShardLayout", "bind_flat_states", "owned_pieces", "ShardedOptimizer",
           "BucketedShardedAdam"]


@dataclass(frozen=True)
class Piece:
    """Where parameter ``index`` meets a rank's slice: ``length`` elements from
    ``start_in_param`` of the (flattened) parameter, at ``start_in_shard`` of the slice."""
    index: int
    start_in_param: int
    start_in_shard: int
    length: int


class ShardLayout:
    """The flat padded layout of ``params`` over ``world_size`` ranks, seen from ``rank``.

    Attributes: ``params``, ``numel`` (Ψ), ``shard_size`` (S), ``padding``, ``offsets`` (of each
    parameter in the flat vector), ``pieces`` (this rank's, in order: :meth:`pieces_of`).
    """

    def __init__(self, params, world_size: int, rank: int):
        self.params = list(params)
        self.world_size, self.rank = world_size, rank
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size, self.padding = partition(max(self.numel, 1), world_size)
        self.offsets, offset = [], 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.pieces = self.pieces_of(rank)

    def pieces_of(self, rank: int) -> list[Piece]:
        """The pieces of rank ``rank``'s slice ``[rank·S, (rank+1)·S)``, in order (the padding
        belongs to no parameter and to no piece)."""
        lo, hi = rank * self.shard_size, (rank + 1) * self.shard_size
        out = []
        for i, (p, offset) in enumerate(zip(self.params, self.offsets)):
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if b > a:
                out.append(Piece(i, a - offset, a - lo, b - a))
        return out

    def pack(self, grads, dtype: torch.dtype) -> torch.Tensor:
        """The input of one ``reduce_scatter_single``: N chunks of S + P elements in ``dtype``;
        chunk r = [slice r of the padded flat gradients, one presence count per parameter
        (1 where ``grads[i]`` is not None, the same in every chunk)]. A missing gradient counts
        as zeros. Returns a tensor of N·(S + P) elements."""
        present = [g is not None for g in grads]
        flat = flatten_padded([g if g is not None else torch.zeros_like(p)
                               for g, p in zip(grads, self.params)], self.padding, dtype)
        counts = torch.tensor(present, dtype=dtype, device=flat.device)
        chunks = flat.view(self.world_size, self.shard_size)  # (N, S)
        return torch.cat([chunks, counts.expand(self.world_size, -1)], dim=1).reshape(-1)

    def unpack(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Split this rank's reduce-scatter output (S + P elements) into ``(gradient slice (S,),
        presence (P,))``: the slice summed over the ranks, and per parameter the number of
        ranks that had a gradient for it."""
        return out[:self.shard_size], out[self.shard_size:]


def bind_flat_states(optim: torch.optim.Optimizer, pieces: list, flats: dict) -> None:
    """Make ``optim``'s per-piece states views of flat tensors: ``flats`` maps a state name
    (``"exp_avg"``) to ``(flat tensor, [(start, length) of each piece])``. A state the optimizer
    already holds (after ``load_state_dict``) is copied into the flat tensor first; a piece
    never stepped gets ``step`` 0 (as a tensor, as ``torch.optim.Adam`` keeps it)."""
    for k, piece in enumerate(pieces):
        state = optim.state[piece]
        for name, (flat, ranges) in flats.items():
            a, n = ranges[k]
            view = flat[a:a + n].view_as(piece)
            if name in state and state[name] is not view:
                view.copy_(state[name])
            state[name] = view
        state.setdefault("step", torch.tensor(0.0))


def _check_options(options: dict) -> None:
    """The options every ``torch.optim`` optimizer shares, checked by name (torch checks only
    the defaults, and names none of them)."""
    for key in ("lr", "eps", "weight_decay", "momentum"):
        if key in options and not isinstance(options[key], torch.Tensor):
            validate.non_negative_number(key, options[key])
    if "betas" in options:
        betas = options["betas"]
        if not (isinstance(betas, (tuple, list)) and all(validate.is_number(b) and 0 <= b < 1
                                                         for b in betas)):
            raise ValueError(f"betas must be numbers in [0, 1), got {betas!r}")


# torch.optim classes whose update of an element reads other elements of its tensor (factored
# moments, a line search over the whole vector, an orthogonalised matrix): a piece of a tensor
# would be updated as if it were the whole tensor. The wrappers refuse them (and subclasses).
NOT_ELEMENTWISE = tuple(c for c in (getattr(torch.optim, n, None) for n in ("Adafactor", "LBFGS", "Muon"))
                        if c is not None)


def _trainable_groups(params) -> list[dict]:
    """``params`` (tensors or groups) → groups of trainable tensors, each tensor once."""
    groups = param_groups(params, {})
    return [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]


class ShardedOptimizer:
    """The given half of a ZeRO wrapper: an optimizer sharded over the ranks of ``group``.

    Every rank builds it with the same parameters (same order, shapes and groups). Parameters
    with ``requires_grad=False`` are frozen: outside the flat vector, never updated, no state.

    Attributes:
        params: the trainable parameters, in order; ``dtype`` their (one) dtype;
            ``master_dtype`` the dtype of the master and the states.
        layout: their :class:`ShardLayout` over this group; ``shard_size``, ``padding``,
            ``numel`` its S, padding and Ψ.
        master: for 16-bit parameters, this rank's fp32 slice of the flat parameters (S
            elements; counted as optimizer state by ``labkit.optimizer_states.state_bytes``);
            None otherwise: the parameters are their own master.
        pieces: one tensor per ``layout.pieces`` entry (parameter ∩ slice): a view of ``master``,
            or of the parameter itself (no copy of what the model holds). ``local_slice()``
            gives the slice as one (S,) tensor.
        optim: ``optimizer_class`` over the pieces, grouped as the parameters were, with each
            group's options; ``param_groups`` is its ``param_groups`` (a scheduler takes
            ``optim``: this wrapper is no ``torch.optim.Optimizer``).
        frozen: the parameters frozen at construction; ``check_trainable()`` (``step`` calls
            it first) refuses, by name, any of them unfrozen since.
    """

    def __init__(self, params, optimizer_class, *, group=None, **defaults):
        validate.process_group("group", group)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError("optimizer_class must be a torch.optim.Optimizer subclass (e.g. "
                            f"torch.optim.Adam), got {optimizer_class!r}")
        if issubclass(optimizer_class, NOT_ELEMENTWISE):
            raise ValueError(f"optimizer_class {optimizer_class.__name__} does not update "
                             "elementwise (an element's update reads the rest of its tensor): "
                             "sharded into pieces, each piece would be updated as a whole tensor; "
                             "wrap an elementwise optimizer (Adam, AdamW, SGD, RMSprop...)")
        every_group = param_groups(params, {})  # params may be a generator: read it once
        self.groups = _trainable_groups(every_group)
        every = [p for g in every_group for p in g["params"]]
        self.frozen = {f"params[{i}] {tuple(p.shape)}": p for i, p in enumerate(every)
                       if not p.requires_grad}  # refused if unfrozen: check_trainable()
        self.params = [p for g in self.groups for p in g["params"]]
        if not self.params:
            raise ValueError("params has no trainable parameter (all have requires_grad=False)")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"trainable params must share one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = self.params[0].dtype
        self.master_dtype = master_dtype(self.dtype, name="params' dtype")
        if len({p.device for p in self.params}) != 1:
            raise ValueError("trainable params must be on one device")
        if not all(p.is_contiguous() for p in self.params):
            raise ValueError("params must be contiguous tensors (their pieces are views of them)")
        for options in [defaults] + [{**defaults, **g} for g in self.groups]:
            _check_options(options)  # named, on every rank, before any collective
        # whatever else the wrapped optimizer refuses, it refuses here too, on every rank before
        # any collective: build it once on an empty tensor
        optimizer_class([{**{k: v for k, v in g.items() if k != "params"}, "params": []}
                         for g in self.groups] + [{"params": [torch.zeros(0)]}], **defaults)
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(f"{type(self).__name__} needs an initialised process group (run it "
                             "inside labkit.ranks.launch)")
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.layout = ShardLayout(self.params, self.world_size, self.rank)
        self.numel, self.shard_size, self.padding = (self.layout.numel, self.layout.shard_size,
                                                     self.layout.padding)
        if self.dtype != self.master_dtype:  # 16-bit parameters: the fp32 master slice
            flat = flatten_padded(self.params, self.padding, self.master_dtype)  # (N·S,)
            self.master = flat[shard_range(self.rank, self.shard_size)].clone()  # (S,)
            self.pieces = [self.master[pc.start_in_shard:pc.start_in_shard + pc.length]
                           for pc in self.layout.pieces]
        else:  # the parameters are their own master: the pieces are views of them
            self.master = None
            self.pieces = [self.params[pc.index].detach().view(-1)[
                pc.start_in_param:pc.start_in_param + pc.length] for pc in self.layout.pieces]
        group_of = {id(p): k for k, g in enumerate(self.groups) for p in g["params"]}
        local = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in self.groups]
        for pc, piece in zip(self.layout.pieces, self.pieces):
            local[group_of[id(self.params[pc.index])]]["params"].append(piece)
        self.optim = optimizer_class(local, **defaults)
        self.param_groups = self.optim.param_groups

    def check_trainable(self) -> None:
        """Refuse a parameter frozen at construction and unfrozen since (it is outside the flat
        vector: it would silently not be trained), naming it."""
        refuse_unfrozen(self.frozen, type(self).__name__)

    def local_slice(self) -> torch.Tensor:
        """This rank's slice of the parameters, (S,) in ``master_dtype``: the master itself for
        16-bit parameters, else a new tensor gathered from the pieces (zeros for the padding)."""
        if self.master is not None:
            return self.master
        out = torch.zeros(self.shard_size, dtype=self.master_dtype, device=self.params[0].device)
        for pc, piece in zip(self.layout.pieces, self.pieces):
            out[pc.start_in_shard:pc.start_in_shard + pc.length] = piece
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients of the trainable parameters (set them to None, or to zero)."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for piece in self.pieces:
            piece.grad = None

    @property
    def state(self):
        """The wrapped optimizer's states (of this rank's pieces)."""
        return self.optim.state

    def shard_state(self) -> dict[str, torch.Tensor]:
        """This rank's states as flat (S,) tensors, one per state name holding a tensor of the
        piece's shape (e.g. ``exp_avg``): each piece's state at its place in the slice, zeros
        for the padding and for pieces without state yet."""
        names = sorted({k for piece in self.pieces for k, v in self.optim.state.get(piece, {}).items()
                        if isinstance(v, torch.Tensor) and v.shape == piece.shape and v.dim() > 0})
        out = {}
        for name in names:
            flat = torch.zeros(self.shard_size, dtype=self.master_dtype, device=self.params[0].device)
            for pc, piece in zip(self.layout.pieces, self.pieces):
                value = self.optim.state.get(piece, {}).get(name)
                if value is not None:
                    flat[pc.start_in_shard:pc.start_in_shard + pc.length] = value.reshape(-1)
            out[name] = flat
        return out

    def state_dict(self) -> dict:
        """This rank's state: the wrapped optimizer's ``state_dict`` (of its pieces) and, for
        16-bit parameters, the master slice. Resume on the same number of ranks, with the same
        parameters (the model's own state_dict holds them)."""
        return {"master": None if self.master is None else self.master.detach().clone(),
                "optim": copy.deepcopy(self.optim.state_dict())}

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume from this rank's ``state_dict()``: the master slice and the optimizer's state."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"master", "optim"}:
            raise ValueError("state_dict must be what state_dict() returned: a dict with "
                             "'master' and 'optim'")
        saved = state_dict["master"]
        if (saved is None) != (self.master is None) or (
                saved is not None and saved.shape != self.master.shape):
            raise ValueError("state_dict holds the state of other parameters or another number of "
                             "ranks: resume on the same ranks, with the same parameters")
        if saved is not None:
            self.master.copy_(saved)
        self.optim.load_state_dict(state_dict["optim"])
        self._after_load()

    def _after_load(self) -> None:
        """What a subclass re-binds after ``load_state_dict`` (flat state views)."""


def owned_pieces(offset: int, numel: int, shard_size: int, world_size: int):
    """Where a parameter at ``[offset, offset + numel)`` of the flat vector meets each shard.

    Returns a list of ``(rank, start_in_param, start_in_shard, length)``, one per rank whose
    slice ``[rank·S, (rank+1)·S)`` overlaps the parameter, in rank order.
    """
    offset, numel = validate.non_negative_int("offset", offset), validate.non_negative_int("numel", numel)
    shard_size = validate.positive_int("shard_size", shard_size)
    world_size = validate.positive_int("world_size", world_size)
    pieces = []
    for rank in range(world_size):
        lo = max(offset, rank * shard_size)
        hi = min(offset + numel, (rank + 1) * shard_size)
        if hi > lo:
            pieces.append((rank, lo - offset, lo - rank * shard_size, hi - lo))
    return pieces


class BucketedShardedAdam(BucketSchedule, ShardedOptimizer):
    """The given half of ``ZeRO2Adam`` (Lab 4, exercise 4.3): ``torch.optim.Adam`` sharded over
    the ranks of ``group`` (:class:`ShardedOptimizer`), the gradient shard and presence counts
    the reduce-scatters fill, Adam's states as flat (S,) tensors, and the fixed buckets
    (``labkit.buckets.BucketSchedule``); it calls the subclass's ``_register_hooks()``.

    Attributes: ``grad_shard`` ((S,), ``master_dtype``: the sum over ranks of this rank's slice
    of the gradient received so far), ``present`` ((P,): per parameter, the presence counts
    received so far), ``state`` (``"exp_avg"``, ``"exp_avg_sq"``, and ``"master"`` for 16-bit
    parameters), ``in_flight`` (the reduce-scatter in flight, or None), ``handles``; and those
    of :class:`ShardedOptimizer` and ``BucketSchedule``.
    """

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, bucket_cap_bytes: int = 25 * 2**20,
                 group=None):
        validate.adam_args(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.bucket_cap_bytes = validate.positive_int("bucket_cap_bytes", bucket_cap_bytes)
        super().__init__(params, torch.optim.Adam, group=group, lr=lr, betas=tuple(betas), eps=eps,
                         weight_decay=weight_decay)
        device = self.params[0].device
        self.grad_shard = torch.zeros(self.shard_size, dtype=self.master_dtype, device=device)
        self.present = torch.zeros(len(self.params), dtype=self.master_dtype, device=device)
        self._flat = {name: torch.zeros(self.shard_size, dtype=self.master_dtype, device=device)
                      for name in ("exp_avg", "exp_avg_sq")}
        self._bind()
        self._plan_buckets(self.params, self.master_dtype.itemsize, self.bucket_cap_bytes)
        self.in_flight = None
        self.handles = []
        self._register_hooks()

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """This rank's states as flat (S,) tensors (plus the fp32 master slice for 16-bit
        parameters)."""
        return {**self._flat, **({"master": self.master} if self.master is not None else {})}

    def _bind(self) -> None:
        ranges = [(pc.start_in_shard, pc.length) for pc in self.layout.pieces]
        bind_flat_states(self.optim, self.pieces, {k: (v, ranges) for k, v in self._flat.items()})

    _after_load = _bind

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard every gradient since the last ``step()``: the full ``.grad`` still held, the
        reduce-scatter in flight (waited for, so every rank's collectives still match),
        ``grad_shard`` and ``present``. With ``set_to_none=False`` a parameter that has had a
        gradient on this rank is left a zero ``.grad``, as ``torch.optim``'s: the next backward
        adds into it and sends it, so the next step updates it even if that backward misses it."""
        self._finish_in_flight()
        self.grad_shard.zero_()
        self.present.zero_()
        super().zero_grad(set_to_none=True)
        if not set_to_none:
            for i in self.had_grad:
                self.params[i].grad = torch.zeros_like(self.params[i])

    def remove(self) -> None:
        """Unregister the hooks."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def _register_hooks(self) -> None:
        raise NotImplementedError  # pragma: no cover - the exercise

    def _finish_in_flight(self) -> None:
        raise NotImplementedError  # pragma: no cover - the exercise
