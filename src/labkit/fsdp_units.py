"""The bookkeeping under ZeRO-3 (Lab 3, exercise 3.7): units, hooks, the order of the
reduce-scatters, the sharded Adam and the measurements — everything but the sharding itself.

A model is cut into *units* (each transformer block ``model.h[i]``, plus the *root*: the
remaining parameters). :class:`ShardedUnits` installs the hooks that call the exercise's
``_gather`` / ``_prefetch`` / ``_free`` around each unit's forward and backward, and
``_reduce_scatter_grads`` once a unit's gradients are complete; it keeps one
``torch.optim.Adam`` over every unit's pieces (``labkit.sharding``: parameter ∩ this rank's
slice, so a parameter without a gradient is skipped and counts its own steps, as Adam does),
whose states are views of each unit's flat ``exp_avg`` / ``exp_avg_sq``.

Order. A collective is matched across ranks by its place in each rank's sequence, and in
backward the reduce-scatters interleave with the all-gathers of the units about to run. So a
unit is reduce-scattered when the gradients this rank's backward will produce for it have all
arrived — which parameters those are is read from the autograd graph at the end of forward, as
``DistributedDataParallel(find_unused_parameters=True)`` reads it — and the units go in one fixed
order, the order backward completes them in a sequential model: the last block first, the root
last. A parameter this rank did not use counts as zeros with a presence count of 0 (the sum of
the counts says whether any rank used it). At the end of the backward (autograd's final
callback, ``labkit.buckets.BackwardEnd``) whatever is left is reduce-scattered, in order. A unit
whose forward ran on no rank in a step is not reduced and its parameters not stepped. Every
rank must run the same units in the same order (FSDP's rule too: the forward's all-gathers are
collectives).

Dtypes: ``labkit.flat_params.master_dtype``, as for ZeRO-1 and ZeRO-2: the full (gathered)
buffers are in the model's dtype, the shards and Adam's states in fp32 (fp64 for an fp64 model).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from labkit.buckets import BackwardEnd
from labkit.flat_params import master_dtype
from labkit.optim_base import refuse_unfrozen, run_closure
from labkit.sharding import ShardLayout, bind_flat_states
from labkit.validate import adam_args, boolean, process_group

__all__ = ["Unit", "ShardedUnits"]


def _grad_fns(output) -> list:
    """The autograd nodes of every tensor in ``output`` (a tensor, or a tuple/list/dict of them)."""
    if isinstance(output, torch.Tensor):
        return [output.grad_fn] if output.grad_fn is not None else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [fn for item in output for fn in _grad_fns(item)]
    return []


class Unit:
    """One unit's bookkeeping on this rank.

    Attributes:
        module: the module whose forward brackets the unit (the model itself for the root).
        params: the unit's parameters, in order (frozen ones too: they are sharded and
            gathered, never updated); their ``.data`` are views into ``full``.
        layout: their ``labkit.sharding.ShardLayout`` over the group (``pack``/``unpack`` the
            reduce-scatter with one presence count per parameter); ``numel``, ``shard_size``,
            ``padding``: Ψ_unit, S = ceil(Ψ_unit/N), N·S − Ψ_unit.
        dtype, master_dtype: of the parameters (and ``full``), and of ``shard`` and the states.
        full: the padded flat buffer of N·S elements; its storage is resized to 0 bytes
            while the unit is freed.
        shard: this rank's slice of the parameters (S elements), persistent.
        grad: this rank's averaged gradient slice after backward (None before); ``present``:
            per parameter, how many ranks had its gradient (None before).
        exp_avg, exp_avg_sq: Adam's states for the slice (flat views of the optimizer's).
        pieces: the views of ``shard`` the optimizer updates (trainable parameters only).
    """

    def __init__(self, module: nn.Module, params: list[nn.Parameter]):
        self.module, self.params = module, params
        self.numel = sum(p.numel() for p in params)
        self.trainable = sum(p.requires_grad for p in params)  # gradients to wait for
        self.layout = None
        self.shard_size = self.padding = 0
        self.dtype = params[0].dtype if params else torch.float32
        self.master_dtype = master_dtype(self.dtype, name="model's dtype")
        self.full = self.shard = self.grad = self.present = self.exp_avg = self.exp_avg_sq = None
        self.pieces: list[torch.Tensor] = []
        self.piece_info: list = []  # the layout's pieces of the trainable parameters, one per piece
        self.grads_ready = 0
        self.expected = self.trainable  # the gradients this backward will bring (set in forward)
        self.complete = self.ran = False
        self.pending = None  # the handle of a prefetch all-gather still in flight


class ShardedUnits:
    """The given half of ZeRO-3 on ``model`` over a process group (see the module).

    Build it on every rank with the same model (same initial weights); it installs hooks, so
    ``loss = model(x, y); loss.backward(); zero3.step()`` trains with sharded parameters.

    Args:
        model: a ``labkit.models.GPT`` (anything with a ModuleList ``h`` of blocks), with one
            floating dtype.
        lr, betas, eps: as ``torch.optim.Adam`` (no weight decay).
        group: the process group (None: the default group).
        prefetch: start the all-gather of the block that runs next before this block computes.

    Attributes:
        units: the blocks' units, then the root's; ``order``: the order of the reduce-scatters.
        optim: ``torch.optim.Adam`` over every unit's pieces.
        peak_live_bytes: the most bytes of gathered (full) parameter buffers, measured from
            their storages after every gather the hooks trigger.
        events: what happened, in order: ("all_gather", unit index, asynchronous?) when an
            all-gather is issued (under :meth:`log_all_gathers`), ("forward_end", i),
            ("backward_start", i), ("backward_end", i) for block i.
    """

    def __init__(self, model: nn.Module, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 group=None, prefetch: bool = False):
        boolean("prefetch", prefetch)
        process_group("group", group)
        adam_args(lr=lr, betas=betas, eps=eps)
        if not isinstance(getattr(model, "h", None), nn.ModuleList) or len(model.h) == 0:
            raise ValueError("model must have a non-empty ModuleList 'h' of blocks (a labkit GPT)")
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        if len(dtypes) != 1:
            raise ValueError(f"model's parameters must share one dtype, got {dtypes}")
        master_dtype(next(model.parameters()).dtype, name="model's dtype")  # floating, trainable
        self.model, self.lr, self.betas, self.eps, self.group = model, float(lr), tuple(betas), eps, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.peak_live_bytes = 0
        self.prefetch, self.events = prefetch, []
        self.frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
        in_blocks = {id(p) for b in model.h for p in b.parameters()}
        self.units = [Unit(b, list(b.parameters())) for b in model.h]
        self.units.append(Unit(model, [p for p in model.parameters() if id(p) not in in_blocks]))
        for u in self.units:
            u.layout = ShardLayout(u.params, self.world_size, self.rank)
            if u.params:
                self._shard(u)
            else:  # a root with no parameters of its own (all are in blocks): nothing to shard
                u.full, u.shard = torch.zeros(0, dtype=u.dtype), torch.zeros(0, dtype=u.master_dtype)
        self.order = self.units[-2::-1] + [self.units[-1]]  # backward's: last block first, root last
        self.next_unit = 0  # position in order of the next unit to reduce-scatter
        self.backward_end = BackwardEnd(self._end_of_backward)
        self.had_grad: dict[int, nn.Parameter] = {}  # the parameters that have had a gradient
        self._build_optimizer()
        for u in self.units[:-1]:
            self._install_block_hooks(u)
        self._install_root_hooks(self.units[-1])

    # ---- the sharded Adam

    def _build_optimizer(self) -> None:
        pieces = []
        for u in self.units:
            u.exp_avg, u.exp_avg_sq = torch.zeros_like(u.shard), torch.zeros_like(u.shard)
            mine = [pc for pc in u.layout.pieces if u.params[pc.index].requires_grad]
            u.pieces = [u.shard[pc.start_in_shard:pc.start_in_shard + pc.length] for pc in mine]
            u.piece_info = mine
            pieces += u.pieces
        placeholder = [] if pieces else [torch.zeros(0)]  # a rank that owns no trainable element
        self.optim = torch.optim.Adam(pieces + placeholder, lr=self.lr, betas=self.betas, eps=self.eps)
        self._bind()

    def _bind(self) -> None:
        for u in self.units:
            ranges = [(pc.start_in_shard, pc.length) for pc in u.piece_info]
            bind_flat_states(self.optim, u.pieces, {"exp_avg": (u.exp_avg, ranges),
                                                     "exp_avg_sq": (u.exp_avg_sq, ranges)})

    @torch.no_grad()
    def step(self, closure=None):
        """Adam on every unit's pieces with the averaged gradient slices, each parameter as
        ``torch.optim.Adam`` would (skipped where no rank had its gradient); then forget the
        slices. The full parameters are refreshed by the next gather. ``closure`` (optional)
        runs first, as for ``torch.optim``; its loss is returned."""
        loss = run_closure(closure)
        refuse_unfrozen(self.frozen, type(self).__name__)  # frozen at construction: not sharded
        self._step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget every gradient since the last ``step()``: any full gradient still held and
        the units' gradient slices, as an optimizer's ``zero_grad``; lets ZeRO-3 stand where a
        ``torch.optim`` optimizer does. With ``set_to_none=False`` a parameter that has had a
        gradient on this rank is left a zero ``.grad``, as ``torch.optim``'s: the next backward
        adds into it and reduce-scatters it, so the next step updates it even if that backward
        misses it."""
        for p in self.model.parameters():
            p.grad = None
        for u in self.units:
            u.grad = u.present = None
        if not set_to_none:
            for p in self.had_grad.values():
                p.grad = torch.zeros(p.shape, dtype=p.dtype)

    def state_dict(self) -> dict:
        """This rank's state: the shards and Adam's state of its pieces. Resume with a new
        ZeRO3 on the same ranks, on a model holding ``full_parameters()``."""
        return {"shards": [u.shard.detach().clone() for u in self.units],
                "optim": self.optim.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume from this rank's ``state_dict()``."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"shards", "optim"}:
            raise ValueError("state_dict must be what state_dict() returned: a dict with "
                             "'shards' and 'optim'")
        shards = state_dict["shards"]
        if len(shards) != len(self.units) or any(s.shape != u.shard.shape
                                                  for s, u in zip(shards, self.units)):
            raise ValueError("state_dict holds the shards of another model or number of ranks")
        for u, s in zip(self.units, shards):
            u.shard.copy_(s)
        self.optim.load_state_dict(state_dict["optim"])
        self._bind()

    # ---- the order of the reduce-scatters

    def _expect_gradients(self, output) -> None:
        """At the end of forward: for each unit, how many of its trainable parameters the
        backward of ``output`` will reach (a walk of the autograd graph, as DDP's
        ``find_unused_parameters``)."""
        reached, seen = set(), set()
        stack = [fn for fn in _grad_fns(output)]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            variable = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf
            if variable is not None:
                reached.add(id(variable))
            stack.extend(next_fn for next_fn, _ in fn.next_functions)
        for u in self.units:
            u.expected = sum(p.requires_grad and id(p) in reached for p in u.params)

    def _on_grad(self, u: Unit, param: nn.Parameter) -> None:
        self.backward_end.arm()
        self.had_grad[id(param)] = param
        u.grads_ready += 1
        if u.grads_ready == u.expected:
            u.complete = True
            if u is not self.units[-1]:
                self.events.append(("backward_end", self.units.index(u)))
            self._reduce_ready_units(flush=False)

    def _reduce_ready_units(self, flush: bool) -> None:
        """Reduce-scatter, in ``order``, every unit whose turn has come: complete ones (all
        units that ran, at the end of backward); units that did not run are passed over."""
        while self.next_unit < len(self.order):
            u = self.order[self.next_unit]
            if u.ran and u.trainable and not (u.complete or flush):
                return
            if u.ran and u.trainable:
                self._reduce_scatter_grads(u)
            self.next_unit += 1

    def _end_of_backward(self) -> None:
        """Run by autograd when a backward ends: reduce-scatter what is left, in order; free
        any unit still gathered (one with nothing to reduce: all its parameters frozen)."""
        self._reduce_ready_units(flush=True)
        for u in self.units:
            if u.pending is not None:
                u.pending.wait()
                u.pending = None
            if u.full.untyped_storage().nbytes():
                self._free(u)
            u.grads_ready, u.complete, u.ran, u.expected = 0, False, False, u.trainable
        self.next_unit = 0

    # ---- the hooks

    def _gather_and_measure(self, u: Unit, then: Unit | None = None) -> None:
        """Gather ``u``; with prefetch on, start gathering ``then`` (the unit that runs next)."""
        u.ran = True
        self._gather(u)
        if self.prefetch and then is not None:
            self._prefetch(then)
        live = sum(v.full.untyped_storage().nbytes() for v in self.units)
        self.peak_live_bytes = max(self.peak_live_bytes, live)

    def _install_grad_hooks(self, u: Unit) -> None:
        for p in u.params:
            if p.requires_grad:  # a frozen parameter gets no gradient (and takes no hook)
                p.register_post_accumulate_grad_hook(lambda p, u=u: self._on_grad(u, p))

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
        u.module.register_forward_hook(lambda module, args, out: self._expect_gradients(out))
        self._install_grad_hooks(u)

    # ---- what the graders and the lab read

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

    # ---- the exercise (labkit.lab3.zero3.ZeRO3)

    def _shard(self, u: Unit) -> None:
        raise NotImplementedError  # pragma: no cover

    def _gather(self, u: Unit) -> None:
        raise NotImplementedError  # pragma: no cover

    def _prefetch(self, u: Unit) -> None:
        raise NotImplementedError  # pragma: no cover

    def _free(self, u: Unit) -> None:
        raise NotImplementedError  # pragma: no cover

    def _reduce_scatter_grads(self, u: Unit) -> None:
        raise NotImplementedError  # pragma: no cover

    def _step(self) -> None:
        raise NotImplementedError  # pragma: no cover
