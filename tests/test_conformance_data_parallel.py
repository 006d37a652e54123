"""Conformance of every data-parallel wrapper and communication hook of the course, against
``torch.nn.parallel.DistributedDataParallel`` run on the same real gloo ranks.

Every wrapper and hook is registered once in ``REGISTRY`` (a test fails when a lab module
defines a data-parallel piece — an optimizer taking a process ``group``, a module with
``finish``, a function named ``*_hook`` — that is not registered). The battery, on 2, 3 and 5
ranks of the world and on a world of 4 split into two subgroups of 2 (each on its own data),
with a few launches that each run every check:

* **parameters used on some ranks only** (conditional computation): a block that runs on rank 0
  only, a parameter used on rank 0 only inside a block every rank runs, a parameter no rank
  uses, a block no rank runs: the gradients (BucketedDDP) or the parameters after Adam (ZeRO-1,
  ZeRO-2, ZeRO-3) equal ``DistributedDataParallel(find_unused_parameters=True)`` (+
  ``torch.optim.Adam``): the average with zeros from the ranks that did not use it, no
  gradient (and no step) where no rank did;
* **several backwards** before one step, and **no_sync()** (the backwards but the last only
  accumulate locally), as DDP;
* **bucket caps** from one element to larger than the model (BucketedDDP, ZeRO-2);
* **hooks on a fresh DDP across its bucket rebuild** (several buckets, whose order the rebuild
  changes): ``powersgd_hook`` equals PyTorch's ``powerSGD_hook`` with ``start_powerSGD_iter=2``
  on the same fresh DDP, step by step; ``compression_hook`` (int8, top-K, random-K) equals the
  same hook started on a DDP that had already rebuilt its buckets; and a hook told to keep
  state from the first iteration (``start_iter=0``) is refused, by name, when the rebuild moves
  its buckets — never silently misplaced.

What each conforms to, and its documented deviations:

* ``BucketedDDP`` (4.2) — ``DistributedDataParallel(find_unused_parameters=True)``'s gradients,
  no_sync included. Deviation: BucketedDDP keeps its first bucket assignment (DDP rebuilds its
  buckets once, in the order rank 0 saw gradients arrive).
* ``ZeRO1`` (2.5) — DDP + the wrapped optimizer (Adam). Deviation: ZeRO1 needs no no_sync(): it
  reduces in step(), so every backward before it only accumulates locally.
* ``ZeRO2Adam`` (4.3) — DDP + ``torch.optim.Adam``, no_sync included.
* ``ZeRO3`` (3.7) — DDP + ``torch.optim.Adam``. Deviation: ZeRO3 needs every rank to run the same
  units (a block run on some ranks only would unmatch the forward's all-gathers: not run here);
  a parameter used on some ranks only inside a unit every rank runs is handled as DDP handles
  it. Deviation: ZeRO3 has no no_sync(): each backward reduce-scatters.
* ``compression_hook`` (4.4) — the plain computation of its scheme (its grader), from the same
  rebuilt buckets as DDP; DDP's own all-reduce before ``start_iter``.
* ``powersgd_hook`` (4.5) — PyTorch's ``powerSGD_hook`` (error feedback, warm start,
  ``min_compression_rate=1``), ``start_iter`` as its ``start_powerSGD_iter``.

Tolerances: fp64 for the wrappers: the same sums in another order (a reduce-scatter of buckets
vs DDP's all-reduce of its buckets, which divides before it sums) differ by ulps of 1e-16:
gradients at rtol 1e-9 / atol 1e-12; parameters after Adam at atol 1e-9, because where the
ranks' gradients cancel one order gives exactly 0 and the other a few ulps, which Adam's
division by √v + ε (ε = 1e-8) turns into a step of ~2e-10. The hooks run the course's GPT in fp32: against PyTorch's hook, the
same power iteration with the all-reduces summed in another order: rtol 1e-4 / atol 1e-6 (a
few ulps of gradients of order 1e-2, amplified by the orthogonalisation); a hook against
itself, bit for bit.
"""
from __future__ import annotations

import copy
import functools
import importlib
import inspect
import pkgutil

import pytest
import torch

from _conformance_helpers import ALL, Toy, gradients

F64 = dict(rtol=1e-9, atol=1e-12)
# Adam divides by √v + ε: where the ranks' gradients cancel, one sum order gives exactly 0 and the
# other a few ulps (~4e-17), which Adam turns into a step of lr·4e-17/ε = 2e-10.
ADAM64 = dict(rtol=1e-9, atol=1e-9)
HOOK_TOL = dict(rtol=1e-4, atol=1e-6)
LR = 0.05
CAPS = (8, 200, 10 ** 9)  # fp64 bytes: one element, a few parameters, more than the model
REGISTRY = {  # name -> exercise
    "BucketedDDP": "4.2", "ZeRO1": "2.5", "ZeRO2Adam": "4.3", "ZeRO3": "3.7",
    "compression_hook": "4.4", "powersgd_hook": "4.5",
}
DEVIATIONS = {
    "BucketedDDP": ("BucketedDDP keeps its first bucket assignment",),
    "ZeRO1": ("ZeRO1 needs no no_sync()",),
    "ZeRO3": ("ZeRO3 needs every rank to run the same units", "ZeRO3 has no no_sync()"),
}
CONFIGS = {"N=2": (2, None), "N=3": (3, None), "N=5": (5, None), "two groups of 2": (4, 2)}


# ---------------------------------------------------------------- the registry itself

def lab_data_parallel() -> set[str]:
    """Every data-parallel piece a lab module defines."""
    found = set()
    for n in range(1, 8):
        pkg = importlib.import_module(f"labkit.lab{n}")
        for m in pkgutil.iter_modules(pkg.__path__):
            mod = importlib.import_module(f"labkit.lab{n}.{m.name}")
            for name, obj in vars(mod).items():
                if getattr(obj, "__module__", None) != mod.__name__:
                    continue
                if inspect.isclass(obj):
                    takes_group = "group" in inspect.signature(obj.__init__).parameters
                    if (takes_group and hasattr(obj, "zero_grad")
                            and not issubclass(obj, torch.nn.Module)) or hasattr(obj, "finish"):
                        found.add(name)
                elif inspect.isfunction(obj) and name.endswith("_hook"):
                    found.add(name)
    return found


def test_every_data_parallel_piece_of_the_labs_is_registered():
    missing = sorted(lab_data_parallel() - set(REGISTRY))
    assert not missing, (f"{missing} are defined in the labs but not registered in "
                         "tests/test_conformance_data_parallel.py's REGISTRY")


def test_every_deviation_is_named_in_the_docstring():
    doc = " ".join(__doc__.split())
    for name, exercise in REGISTRY.items():
        assert f"``{name}`` ({exercise})" in doc, name
        for text in DEVIATIONS.get(name, ()):
            assert text in doc, f"{name}'s deviation {text!r} is not in the module docstring"


# ---------------------------------------------------------------- the ranks' side

def _group(rank, world_size, size):
    import torch.distributed as dist

    if size is None:
        return None, list(range(world_size))
    mine = None
    for start in range(0, world_size, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group, ranks
    return mine


def _plans(n):
    """Per plan: steps × ranks × backwards of the parameter names used (see the docstring)."""
    rest = [[set(ALL) - {"h.1.weight"}]] * (n - 1)
    units = [[[set(ALL) - {"h.1.weight", "h.1.bias"}]] * n,  # block h.1 runs on no rank
             [[set(ALL)]] + rest,  # h.1.weight on rank 0 only, its block on every rank
             [[set(ALL) - {"h.0.bias"}, {"h.0.weight", "head"}]] * n,  # h.0.bias on none; 2 backwards
             [[set(ALL)]] * n]
    blocks = [[[set(ALL)]] + [[set(ALL) - {"h.1.weight", "h.1.bias"}]] * (n - 1),  # h.1 on rank 0 only
              [[set(ALL) - {"head"}]] * n,
              [[set(ALL)]] * n]
    return {"units": units, "blocks": blocks}


def _data(plan, ranks):
    """The gradients of ``plan`` for a group of ``ranks``: its own data (seeded by its first rank)."""
    return gradients(plan, torch.float64, seed=1 + ranks[0])


def _grads(model):
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _ddp(G, me, group, *, adam, no_sync=False):
    """DDP(find_unused_parameters=True) on the toy (+ Adam): per step the gradients after its
    backwards (the first ones inside no_sync() if asked) and the parameters after the step."""
    from torch.nn.parallel import DistributedDataParallel

    model = Toy(torch.float64)
    ddp = DistributedDataParallel(model, process_group=group, find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=LR) if adam else None
    grads, params = [], []
    for step in G:
        backwards = step[me]
        for k, g in enumerate(backwards):
            if no_sync and k < len(backwards) - 1:
                with ddp.no_sync():
                    ddp(g).backward()
            else:
                ddp(g).backward()
        grads.append(_grads(model))
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)
        params.append(_params(model))
    return grads, params


def _bucketed(G, me, group, cap, *, no_sync=False):
    from labkit.lab4.bucketed_ddp import BucketedDDP

    model = Toy(torch.float64)
    ddp = BucketedDDP(model, bucket_cap_bytes=cap, group=group)
    out = []
    for step in G:
        backwards = step[me]
        for k, g in enumerate(backwards):
            if no_sync and k < len(backwards) - 1:
                with ddp.no_sync():
                    ddp(g).backward()
            else:
                ddp(g).backward()
        ddp.finish()
        out.append(_grads(model))
        model.zero_grad(set_to_none=True)
    return out


def _optimizer(name, G, me, group, cap=None, *, no_sync=False):
    model = Toy(torch.float64)
    if name == "ZeRO1":
        from labkit.lab2.zero1 import ZeRO1
        opt = ZeRO1(list(model.parameters()), torch.optim.Adam, group=group, lr=LR)
    elif name == "ZeRO2Adam":
        from labkit.lab4.zero2 import ZeRO2Adam
        opt = ZeRO2Adam(list(model.parameters()), lr=LR, group=group, bucket_cap_bytes=cap)
    else:
        from labkit.lab3.zero3 import ZeRO3
        opt = ZeRO3(model, lr=LR, group=group)
    out = []
    for step in G:
        backwards = step[me]
        for k, g in enumerate(backwards):
            if no_sync and k < len(backwards) - 1:
                with opt.no_sync():
                    model(g).backward()
            else:
                model(g).backward()
        opt.step()
        opt.zero_grad()
        out.append(dict(zip([n for n, _ in model.named_parameters()], opt.full_parameters()))
                   if name == "ZeRO3" else _params(model))
    return out


def _wrappers(rank, world_size, group_size):
    group, ranks = _group(rank, world_size, group_size)
    me, out = ranks.index(rank), {"ranks": ranks}
    for plan_name, plan in _plans(len(ranks)).items():
        G = _data(plan, ranks)
        out["ddp", plan_name] = _ddp(G, me, group, adam=True)
        for cap in CAPS:
            out["BucketedDDP", plan_name, cap] = _bucketed(G, me, group, cap)
            out["ZeRO2Adam", plan_name, cap] = _optimizer("ZeRO2Adam", G, me, group, cap)
        out["ZeRO1", plan_name] = _optimizer("ZeRO1", G, me, group)
        if plan_name == "units":
            out["ZeRO3", plan_name] = _optimizer("ZeRO3", G, me, group)
    # no_sync: three backwards per step, the first two inside no_sync()
    G = _data([[[set(ALL), set(ALL) - {"head"}, {"h.0.weight"}]] * len(ranks)] * 2, ranks)
    out["ddp", "no_sync"] = _ddp(G, me, group, adam=True, no_sync=True)
    out["BucketedDDP", "no_sync", 200] = _bucketed(G, me, group, 200, no_sync=True)
    out["ZeRO2Adam", "no_sync", 200] = _optimizer("ZeRO2Adam", G, me, group, 200, no_sync=True)
    return out


@functools.lru_cache(maxsize=None)
def wrapper_results(config):
    from labkit.ranks import launch

    world_size, group_size = CONFIGS[config]
    return launch(_wrappers, world_size, group_size, timeout=180)


def _close(got, want, what, tol=F64):
    for s, (g, w) in enumerate(zip(got, want)):
        for name, value in w.items():
            if value is None:
                assert g[name] is None, f"{what}: {name} has a gradient after step {s + 1}, DDP leaves None (no rank used it)"
                continue
            assert g[name] is not None, f"{what}: {name} has no gradient after step {s + 1}, DDP's is {value}"
            torch.testing.assert_close(g[name], value, **tol, msg=lambda m, s=s, name=name: (
                f"{what}: {name} after step {s + 1} differs from DistributedDataParallel's: {m}"))


@pytest.mark.parametrize("config", CONFIGS)
def test_wrappers_equal_ddp_with_unused_parameters_caps_and_no_sync(config):
    """BucketedDDP's gradients and ZeRO-1/2/3's parameters after Adam against DDP(find_unused_
    parameters=True) (+ Adam) on the same ranks and data: blocks and parameters used on some
    ranks or none, several backwards, every bucket cap, no_sync()."""
    for rank, out in enumerate(wrapper_results(config)):
        where = f"{config}, rank {rank} (group {out['ranks']})"
        for plan_name in ("units", "blocks"):
            ddp_grads, ddp_params = out["ddp", plan_name]
            for cap in CAPS:
                _close(out["BucketedDDP", plan_name, cap], ddp_grads,
                       f"BucketedDDP, {where}, plan {plan_name!r}, cap {cap} B")
                _close(out["ZeRO2Adam", plan_name, cap], ddp_params,
                       f"ZeRO2Adam, {where}, plan {plan_name!r}, cap {cap} B", ADAM64)
            _close(out["ZeRO1", plan_name], ddp_params, f"ZeRO1, {where}, plan {plan_name!r}", ADAM64)
            if plan_name == "units":
                _close(out["ZeRO3", plan_name], ddp_params, f"ZeRO3, {where}, plan {plan_name!r}", ADAM64)
        ddp_grads, ddp_params = out["ddp", "no_sync"]
        _close(out["BucketedDDP", "no_sync", 200], ddp_grads, f"BucketedDDP, {where}, no_sync()")
        _close(out["ZeRO2Adam", "no_sync", 200], ddp_params, f"ZeRO2Adam, {where}, no_sync()", ADAM64)


# ---------------------------------------------------------------- hooks across the rebuild

HOOK_STEPS = 4


def _gpt():
    from labkit.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=False))


def _hook_run(model, batches, me, group, hook=None, state=None, *, settle=None):
    """A fresh DDP of ``model`` (one bucket, whose order the rebuild changes) trained by SGD;
    ``hook`` registered at once, or after ``settle`` plain iterations. Returns the gradients of
    every step, or the error a step raised."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(copy.deepcopy(model), process_group=group, bucket_cap_mb=1024)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    for s, step in enumerate(batches):
        if hook is not None and s == (settle or 0):
            ddp.register_comm_hook(state, hook)
        x, y = step[me]
        try:
            ddp(x, y).backward()
        except RuntimeError as exc:
            return f"{type(exc).__name__}: {exc}"
        grads.append(_grads(ddp.module))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


def _hooks(rank, world_size, group_size):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    from labkit.lab4.compression import CompressionState, compression_hook
    from labkit.lab4.powersgd import PowerSGDState, powersgd_hook
    from labkit.models import SyntheticData

    group, ranks = _group(rank, world_size, group_size)
    me, model = ranks.index(rank), _gpt()
    data = SyntheticData(32, 8, 2, seed=1)
    batches = [[data.batch(s * world_size + r) for r in ranks] for s in range(HOOK_STEPS)]
    theirs = torch_psgd.PowerSGDState(group, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                      min_compression_rate=1, use_error_feedback=True,
                                      warm_start=True, random_seed=0)
    out = {"ranks": ranks,
           "powersgd": _hook_run(model, batches, me, group, powersgd_hook, PowerSGDState(2, group)),
           "torch powersgd": _hook_run(model, batches, me, group, torch_psgd.powerSGD_hook, theirs),
           "powersgd start_iter=0": _hook_run(model, batches, me, group, powersgd_hook,
                                              PowerSGDState(2, group, start_iter=0))}
    for scheme in ("int8", "topk", "randomk"):
        options = dict(density=0.3, chunk=16, process_group=group)
        out[scheme, "fresh"] = _hook_run(model, batches, me, group, compression_hook,
                                         CompressionState(scheme, **options))
        out[scheme, "settled"] = _hook_run(model, batches, me, group, compression_hook,
                                           CompressionState(scheme, start_iter=1, **options), settle=1)
        out[scheme, "start_iter=0"] = _hook_run(model, batches, me, group, compression_hook,
                                                CompressionState(scheme, start_iter=0, **options))
    return out


@functools.lru_cache(maxsize=None)
def hook_results(config):
    from labkit.ranks import launch

    world_size, group_size = CONFIGS[config]
    return launch(_hooks, world_size, group_size, timeout=180)


@pytest.mark.parametrize("config", ["N=2", "two groups of 2"])
def test_hooks_on_a_fresh_ddp_survive_its_bucket_rebuild(config):
    """Hooks registered on a fresh DDP (several buckets, reordered by the rebuild after the first
    iteration): powersgd_hook equals torch's powerSGD_hook (start_powerSGD_iter=2) at every
    step; compression_hook equals itself started on a DDP that had already rebuilt; with
    start_iter=0 both are refused by name when the rebuild moves their buckets."""
    for rank, out in enumerate(hook_results(config)):
        where = f"{config}, rank {rank} (group {out['ranks']})"
        ours, theirs = out["powersgd"], out["torch powersgd"]
        assert not isinstance(ours, str), f"{where}: powersgd_hook on a fresh DDP raised {ours}"
        for s, (g, w) in enumerate(zip(ours, theirs)):
            for name, value in w.items():
                torch.testing.assert_close(g[name], value, **HOOK_TOL, msg=lambda m, s=s, name=name: (
                    f"{where}: powersgd_hook's {name} gradient at step {s + 1} differs from torch's "
                    f"powerSGD_hook's on a fresh DDP: {m}"))
        for label in ("powersgd start_iter=0", *[(s, "start_iter=0") for s in ("int8", "topk", "randomk")]):
            got = out[label]
            assert isinstance(got, str) and "rebuilt" in got and "start_iter" in got, (
                f"{where}: {label}: a hook keeping state from the first iteration of a fresh DDP "
                f"must be refused when DDP rebuilds its buckets, got {got if isinstance(got, str) else 'no error'}")
        for scheme in ("int8", "topk", "randomk"):
            fresh, settled = out[scheme, "fresh"], out[scheme, "settled"]
            assert not isinstance(fresh, str), f"{where}: {scheme} on a fresh DDP raised {fresh}"
            for s, (g, w) in enumerate(zip(fresh, settled)):
                for name, value in w.items():
                    assert torch.equal(g[name], value), (
                        f"{where}: compression_hook ({scheme}) on a fresh DDP gives {name} at step "
                        f"{s + 1} unlike the same hook started after the rebuild: is its state kept "
                        "from the first iteration (before DDP rebuilt its buckets)?")
