"""What the two conformance suites share (tests/test_conformance_*.py); not collected.

**The toy model.** ``Toy`` has two blocks ``h.0``, ``h.1`` (each a 4×6 ``weight`` and a
6-vector ``bias``), a root 3×5 ``head`` and a frozen 5-vector. Its loss is *linear* in the
parameters: ``Toy(...)(grads)`` returns Σ (p · G_p) over the parameters named in ``grads``, so
backward leaves exactly ``G_p`` in ``p.grad`` — the gradients are chosen by the test, every
parameter's trajectory is its own, and the reference can be computed without a model. A block
none of whose parameters is named does not run at all (conditional computation: ZeRO-3 then
never gathers it); one whose parameters are only partly named runs, the others getting no
gradient.

**Plans.** A plan is a list of steps; a step is a list, one entry per rank, of the backward
passes that rank runs before ``step()``: each a set of parameter names used. The gradients
``G[step][rank][backward][name]`` are drawn from a seed, rounded to multiples of 1/64 (sums of
a few are then exact in any order, in fp32 and fp64: the reference and a reduce-scatter agree
to the last bit before the optimizer's own arithmetic).

**The reference** (:func:`reference_run`) is what ``DistributedDataParallel(find_unused_parameters
=True)`` + a ``torch.optim`` optimizer compute, written plainly: per step each rank's gradient
is the sum of its backwards; the average over the ranks counts a rank that did not use a
parameter as zeros; a parameter no rank used gets no gradient (DDP leaves ``.grad`` None: the
optimizer skips it); 16-bit parameters are stepped through an fp32 master (``master=True``).
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

BLOCK_SHAPES = {"weight": (4, 6), "bias": (6,)}
TRAINABLE = ["h.0.weight", "h.0.bias", "h.1.weight", "h.1.bias", "head"]
ALL = frozenset(TRAINABLE)


class ToyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*BLOCK_SHAPES["weight"]))
        self.bias = nn.Parameter(torch.randn(*BLOCK_SHAPES["bias"]))

    def forward(self, carry, grads: dict):
        for name, g in grads.items():
            carry = carry + (getattr(self, name) * g).sum()
        return carry


class Toy(nn.Module):
    """The toy model (see the module docstring). ``model(grads)`` → the linear loss."""

    def __init__(self, dtype=torch.float32, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.h = nn.ModuleList([ToyBlock(), ToyBlock()])
        self.head = nn.Parameter(torch.randn(3, 5))
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)
        self.to(dtype)

    def forward(self, grads: dict):
        carry = (self.frozen * 0.5).sum()  # the frozen parameter is used, and gets no gradient
        for i, block in enumerate(self.h):
            mine = {k.split(".")[-1]: g for k, g in grads.items() if k.startswith(f"h.{i}.")}
            if mine:
                carry = block(carry, mine)
        if "head" in grads:
            carry = carry + (self.head * grads["head"]).sum()
        return carry


def shapes(model: nn.Module) -> dict:
    return {n: p.shape for n, p in model.named_parameters()}


SHAPES = {"h.0.weight": (4, 6), "h.0.bias": (6,), "h.1.weight": (4, 6), "h.1.bias": (6,),
          "head": (3, 5)}

def gradients(plan, dtype, seed: int = 1) -> list:
    """G[step][rank][backward] = {name: tensor} for the names that backward uses."""
    gen = torch.Generator().manual_seed(seed)
    sizes = shapes(Toy())
    out = []
    for step in plan:
        out.append([[{name: (torch.randn(sizes[name], generator=gen) * 16).round().div(64).to(dtype)
                      for name in sorted(used)} for used in backwards] for backwards in step])
    return out


def plan_of(steps: int, ranks: int = 1, backwards: int = 1, used=ALL) -> list:
    """Every rank uses ``used`` in each of its ``backwards`` at every one of ``steps``."""
    return [[[set(used)] * backwards for _ in range(ranks)] for _ in range(steps)]


def with_zeros(G_steps) -> list:
    """What ``zero_grad(set_to_none=False)`` after each step amounts to: a parameter that a rank
    has had a gradient for keeps a zero ``.grad`` there, which counts as a gradient from then on
    (``torch.optim`` zeroes the gradients that exist and leaves None where there is none). Returns
    ``G_steps`` with such a parameter given an explicit zero gradient in every later backward
    that leaves it out."""
    like = next(iter(G_steps[0][0][0].values()))
    out, seen = [], [set() for _ in G_steps[0]]
    for step in G_steps:
        rows = []
        for r, backwards in enumerate(step):
            rows.append([{**{n: like.new_zeros(SHAPES[n]) for n in seen[r]}, **bw} for bw in backwards])
            seen[r] |= {n for bw in backwards for n in bw}
        out.append(rows)
    return out


def run(model: nn.Module, opt, G_steps, rank: int = 0, *, closure: bool = False,
        junk=None, snapshot=None, set_to_none: bool = True) -> list[dict]:
    """Drive ``opt`` on ``model``: per step, this rank's backwards, then ``opt.step()`` (through
    a closure if ``closure``) and ``opt.zero_grad()``. ``junk``: gradients of a backward run
    (and discarded by ``zero_grad()``) before each step's own. Returns the parameters after
    each step, by name (``snapshot()``'s, where the model cannot show them: ZeRO-3 frees them).
    ``set_to_none``: what each step's ``zero_grad`` is told."""
    history = []
    for s, step in enumerate(G_steps):
        if junk is not None:
            model(junk[s][rank][0]).backward()
            opt.zero_grad()
        backwards = step[rank]
        if closure:
            def closure_fn(backwards=backwards):
                loss = None
                for G in backwards:
                    loss = model(G)
                    loss.backward()
                return loss
            loss = opt.step(closure_fn)
            assert loss is not None, "step(closure) must return the closure's loss"
        else:
            for G in backwards:
                model(G).backward()
            opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        history.append(snapshot() if snapshot is not None else
                       {n: p.detach().clone() for n, p in model.named_parameters()})
    return history


def reference_run(model: nn.Module, make_ref, G_steps, world: int, *, master: bool = False,
                  groups=None) -> list[dict]:
    """DDP(find_unused_parameters=True) + ``make_ref(params or groups)`` written plainly (see the
    module docstring) over the first ``world`` ranks of ``G_steps``. ``groups``: lists of
    parameter names, one per group, each with its options: ``[(names, options), ...]``."""
    model = copy.deepcopy(model)
    named = dict(model.named_parameters())
    trainable = {n: p for n, p in named.items() if p.requires_grad}
    held = {n: (p.detach().float().clone().requires_grad_(True) if master else p)
            for n, p in trainable.items()}
    if groups is None:
        opt = make_ref(list(held.values()))
    else:
        opt = make_ref([{"params": [held[n] for n in names], **options} for names, options in groups])
    history = []
    for step in G_steps:
        for name, p in held.items():
            used = [bw[name].to(torch.float64) for r in range(world) for bw in step[r] if name in bw]
            p.grad = None if not used else (sum(used) / world).to(p.dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if master:
            with torch.no_grad():
                for n, p in trainable.items():
                    p.copy_(held[n])
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history


def assert_histories_close(got: list, want: list, what: str, **tol) -> None:
    """Every parameter after every step, with ``tol`` (torch.testing.assert_close); a step's
    parameters by name (a dict) or by position (a list)."""
    assert len(got) == len(want), f"{what}: {len(got)} steps, expected {len(want)}"
    for s, (g, w) in enumerate(zip(got, want)):
        for key in (w if isinstance(w, dict) else range(len(w))):
            label = key if isinstance(w, dict) else f"parameter {key}"
            torch.testing.assert_close(g[key], w[key], **tol, msg=lambda m, s=s, label=label: (
                f"{what}: {label} after step {s + 1}: {m}"))


# ---------------------------------------------------------------- inside ranks (data parallel)

LR = 0.05
# fp64 against DDP: the same sums in another order (DDP divides before it sums) differ by ulps.
F64 = dict(rtol=1e-9, atol=1e-12)
# Adam divides by √v + ε: where the ranks' gradients cancel, one sum order gives exactly 0 and the
# other a few ulps (~4e-17), which Adam turns into a step of lr·4e-17/ε = 2e-10.
ADAM64 = dict(rtol=1e-9, atol=1e-9)


def group_of(rank, world_size, size):
    """This rank's (group, ranks): the world (``size`` None), its group of ``size``
    consecutive ranks (``labkit.reference.lab4.pair_groups``), or, for a list of ranks, the
    group of those (``(None, ranks)`` on a rank outside it; every rank creates it, as
    ``dist.new_group`` requires)."""
    import torch.distributed as dist

    from labkit.reference.lab4 import pair_groups

    if isinstance(size, list):
        group = dist.new_group(size)
        return (group if rank in size else None), size
    return pair_groups(rank, world_size, size)


def dp_plans(n):
    """Two plans for n ranks (steps × ranks × backwards of the parameter names used):
    ``"units"`` never runs a block on some ranks only (ZeRO-3's rule) — block h.1 runs on no
    rank at step 1, h.1.weight is used on rank 0 only at step 2, h.0.bias on no rank at step 3,
    which has two backwards (h.1.weight only in the first, its block in both) —; ``"blocks"``
    runs block h.1 on rank 0 only at step 1."""
    rest = [[set(ALL) - {"h.1.weight"}]] * (n - 1)
    units = [[[set(ALL) - {"h.1.weight", "h.1.bias"}]] * n,  # block h.1 runs on no rank
             [[set(ALL)]] + rest,  # h.1.weight on rank 0 only, its block on every rank
             # h.0.bias on no rank; 2 backwards, h.1.weight only in the first (its block in both)
             [[set(ALL) - {"h.0.bias"}, {"h.0.weight", "h.1.bias", "head"}]] * n,
             [[set(ALL)]] * n]
    blocks = [[[set(ALL)]] + [[set(ALL) - {"h.1.weight", "h.1.bias"}]] * (n - 1),  # h.1 on rank 0 only
              [[set(ALL) - {"head"}]] * n,
              [[set(ALL)]] * n]
    return {"units": units, "blocks": blocks}


def plan_gradients(plan, ranks):
    """The gradients of ``plan`` for a group of ``ranks``: its own data (seeded by its first rank)."""
    return gradients(plan, torch.float64, seed=1 + ranks[0])


def backwards(step_backwards, forward, no_sync=None) -> None:
    """One step's backwards, each through ``forward`` (a model or its wrapper); with ``no_sync``
    (a context-manager factory, DDP's ``no_sync``), all but the last inside it."""
    for k, G in enumerate(step_backwards):
        keep_local = no_sync is not None and k < len(step_backwards) - 1
        with no_sync() if keep_local else contextlib.nullcontext():
            forward(G).backward()


def toy_grads(model):
    """{name: a copy of .grad, or None}."""
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def toy_params(model):
    """{name: a copy of the parameter}."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def ddp_run(G, me, group, *, adam, no_sync=False):
    """DDP(find_unused_parameters=True) on the toy (+ Adam): per step the gradients after its
    backwards (the first ones inside no_sync() if asked) and the parameters after the step."""
    from torch.nn.parallel import DistributedDataParallel

    model = Toy(torch.float64)
    ddp = DistributedDataParallel(model, process_group=group, find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=LR) if adam else None
    grads, params = [], []
    for step in G:
        backwards(step[me], ddp, ddp.no_sync if no_sync else None)
        grads.append(toy_grads(model))
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)
        params.append(toy_params(model))
    return grads, params


def bucketed_run(G, me, group, cap, *, no_sync=False):
    """BucketedDDP on the toy: per step the gradients after its backwards and ``finish()``."""
    from labkit.lab4.bucketed_ddp import BucketedDDP

    model = Toy(torch.float64)
    ddp = BucketedDDP(model, bucket_cap_bytes=cap, group=group)
    out = []
    for step in G:
        backwards(step[me], ddp, ddp.no_sync if no_sync else None)
        ddp.finish()
        out.append(toy_grads(model))
        model.zero_grad(set_to_none=True)
    return out


def zero_optimizer(name, model, group, cap=None):
    """ZeRO-1, ZeRO-2 (bucket ``cap``) or ZeRO-3 with Adam at ``LR`` over ``model``."""
    if name == "ZeRO1":
        from labkit.lab2.zero1 import ZeRO1
        return ZeRO1(list(model.parameters()), torch.optim.Adam, group=group, lr=LR)
    if name == "ZeRO2Adam":
        from labkit.lab4.zero2 import ZeRO2Adam
        return ZeRO2Adam(list(model.parameters()), lr=LR, group=group, bucket_cap_bytes=cap)
    from labkit.lab3.zero3 import ZeRO3
    return ZeRO3(model, lr=LR, group=group)


def optimizer_run(name, G, me, group, cap=None, *, no_sync=False, dtype=torch.float64):
    """ZeRO-1, ZeRO-2 (bucket ``cap``) or ZeRO-3 + Adam on the toy in ``dtype``: the parameters
    after each step."""
    model = Toy(dtype)
    opt = zero_optimizer(name, model, group, cap)
    out = []
    for step in G:
        backwards(step[me], model, opt.no_sync if no_sync else None)
        opt.step()
        opt.zero_grad()
        out.append(dict(zip([n for n, _ in model.named_parameters()], opt.full_parameters()))
                   if name == "ZeRO3" else toy_params(model))
    return out


def assert_runs_close(got: list, want: list, what: str, **tol) -> None:
    """Per step, {name: tensor or None} against the reference's: None exactly where it has None
    (no gradient), else close at ``tol``."""
    for s, (g, w) in enumerate(zip(got, want)):
        for name, value in w.items():
            if value is None:
                assert g[name] is None, (f"{what}: {name} has a gradient after step {s + 1}; "
                                         "DDP leaves None (no rank used it)")
                continue
            assert g[name] is not None, f"{what}: {name} has no gradient after step {s + 1}"
            torch.testing.assert_close(g[name], value, **tol, msg=lambda m, s=s, name=name: (
                f"{what}: {name} after step {s + 1} differs from DistributedDataParallel's: {m}"))
