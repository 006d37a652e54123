"""Conformance of every data-parallel wrapper and communication hook of the course, against
``torch.nn.parallel.DistributedDataParallel`` run on the same real gloo ranks.

Every wrapper and hook is registered once in ``REGISTRY`` (a test fails when a lab module
defines a data-parallel piece — an optimizer taking a process ``group``, a module with
``finish``, a function named ``*_hook`` — that is not registered). The battery, on 1, 2, 3 and 5
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
* **hooks on a fresh DDP across its bucket rebuild** (one bucket, whose order the rebuild
  changes, and several, whose contents it changes): ``powersgd_hook`` equals PyTorch's
  ``powerSGD_hook`` with ``start_powerSGD_iter=2`` on the same fresh DDP, step by step (one
  bucket: torch's hook chains asynchronous all-reduces per bucket, which gloo may pair across
  buckets and hang); ``compression_hook`` (int8, top-K, random-K) equals the
  same hook started on a DDP that had already rebuilt its buckets; and a hook told to keep
  state from the first iteration (``start_iter=0``) is refused, by name, when the rebuild moves
  its buckets — never silently misplaced;
* **edge cases** (one launch each on a world of 1, of 3, and on the non-consecutive subgroup
  {0, 2} of 3): a model with fewer elements than ranks (ZeRO shards of size 0; no parameter
  outside its block: an empty ZeRO-3 root unit), tied weights (GPT's wte/lm_head), a BatchNorm,
  gradients exactly zero, a bucket cap of exactly one parameter's bytes — parameters after Adam
  as DDP + Adam's; buffers as documented below.

What each conforms to, and its documented deviations:

* ``BucketedDDP`` (4.2) — ``DistributedDataParallel(find_unused_parameters=True)``'s gradients,
  no_sync included. Deviation: BucketedDDP keeps its first bucket assignment (DDP rebuilds its
  buckets once, in the order rank 0 saw gradients arrive). Deviation: BucketedDDP does not
  broadcast buffers (DDP's ``broadcast_buffers=True`` sends rank 0's before each forward): each
  rank keeps the BatchNorm running statistics of its own batches.
* ``ZeRO1`` (2.5) — DDP + the wrapped optimizer (Adam). Deviation: ZeRO1 needs no no_sync(): it
  reduces in step(), so every backward before it only accumulates locally. Deviation: ZeRO1
  does not broadcast buffers (an optimizer: each rank keeps its own running statistics).
* ``ZeRO2Adam`` (4.3) — DDP + ``torch.optim.Adam``, no_sync included. Deviation: ZeRO2Adam
  does not broadcast buffers (an optimizer: each rank keeps its own running statistics).
* ``ZeRO3`` (3.7) — DDP + ``torch.optim.Adam``. Deviation: ZeRO3 needs every rank to run the same
  units (a block run on some ranks only would unmatch the forward's all-gathers: not run here);
  a parameter used on some ranks only inside a unit every rank runs is handled as DDP handles
  it. Deviation: ZeRO3 has no no_sync(): each backward reduce-scatters. Deviation: ZeRO3 does
  not broadcast buffers (each rank keeps its own running statistics).
* ``compression_hook`` (4.4) — the plain computation of its scheme (its grader), from the same
  rebuilt buckets as DDP; DDP's own all-reduce before ``start_iter``.
* ``powersgd_hook`` (4.5) — PyTorch's ``powerSGD_hook`` (error feedback, warm start,
  ``min_compression_rate=1``), ``start_iter`` as its ``start_powerSGD_iter``, and
  ``orthogonalization_epsilon`` as its own: on a gradient matrix that is exactly zero both give
  NaN with torch's default 0 and the same finite values with 1e-8.

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

from _conformance_helpers import (ADAM64, ALL, F64, assert_runs_close, bucketed_run, ddp_run,
                                  dp_plans, group_of, optimizer_run, plan_gradients, toy_grads,
                                  zero_optimizer)

HOOK_TOL = dict(rtol=1e-4, atol=1e-6)
LR = 0.05
CAPS = (8, 200, 10 ** 9)  # fp64 bytes: one element, a few parameters, more than the model
REGISTRY = {  # name -> exercise
    "BucketedDDP": "4.2", "ZeRO1": "2.5", "ZeRO2Adam": "4.3", "ZeRO3": "3.7",
    "compression_hook": "4.4", "powersgd_hook": "4.5",
}
DEVIATIONS = {
    "BucketedDDP": ("BucketedDDP keeps its first bucket assignment",
                    "BucketedDDP does not broadcast buffers"),
    "ZeRO1": ("ZeRO1 needs no no_sync()", "ZeRO1 does not broadcast buffers"),
    "ZeRO2Adam": ("ZeRO2Adam does not broadcast buffers",),
    "ZeRO3": ("ZeRO3 needs every rank to run the same units", "ZeRO3 has no no_sync()",
              "ZeRO3 does not broadcast buffers"),
}
CONFIGS = {"N=1": (1, None), "N=2": (2, None), "N=3": (3, None), "N=5": (5, None), "two groups of 2": (4, 2)}


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

def _wrappers(rank, world_size, group_size):
    group, ranks = group_of(rank, world_size, group_size)
    me, out = ranks.index(rank), {"ranks": ranks}
    for plan_name, plan in dp_plans(len(ranks)).items():
        G = plan_gradients(plan, ranks)
        out["ddp", plan_name] = ddp_run(G, me, group, adam=True)
        for cap in CAPS:
            out["BucketedDDP", plan_name, cap] = bucketed_run(G, me, group, cap)
            out["ZeRO2Adam", plan_name, cap] = optimizer_run("ZeRO2Adam", G, me, group, cap)
        out["ZeRO1", plan_name] = optimizer_run("ZeRO1", G, me, group)
        if plan_name == "units":
            out["ZeRO3", plan_name] = optimizer_run("ZeRO3", G, me, group)
    # no_sync: three backwards per step, the first two inside no_sync()
    G = plan_gradients([[[set(ALL), set(ALL) - {"head"}, {"h.0.weight"}]] * len(ranks)] * 2, ranks)
    out["ddp", "no_sync"] = ddp_run(G, me, group, adam=True, no_sync=True)
    out["BucketedDDP", "no_sync", 200] = bucketed_run(G, me, group, 200, no_sync=True)
    out["ZeRO2Adam", "no_sync", 200] = optimizer_run("ZeRO2Adam", G, me, group, 200, no_sync=True)
    return out


@functools.lru_cache(maxsize=None)
def wrapper_results(config):
    from labkit.ranks import launch

    world_size, group_size = CONFIGS[config]
    return launch(_wrappers, world_size, group_size, timeout=180)


@pytest.mark.parametrize("config", CONFIGS)
def test_wrappers_equal_ddp_with_unused_parameters_caps_and_no_sync(config):
    """BucketedDDP's gradients and ZeRO-1/2/3's parameters after Adam against DDP(find_unused_
    parameters=True) (+ Adam) on the same ranks and data: blocks and parameters used on some
    ranks or none, several backwards, every bucket cap, no_sync()."""
    for rank, out in enumerate(wrapper_results(config)):
        where = f"{config}, rank {rank} (group {out['ranks']})"
        for plan_name in ("units", "blocks"):
            ddp_grads, ddp_params = out["ddp", plan_name]
            what = f"{where}, plan {plan_name!r}"
            for cap in CAPS:
                assert_runs_close(out["BucketedDDP", plan_name, cap], ddp_grads,
                                  f"BucketedDDP, {what}, cap {cap} B", **F64)
                assert_runs_close(out["ZeRO2Adam", plan_name, cap], ddp_params,
                                  f"ZeRO2Adam, {what}, cap {cap} B", **ADAM64)
            assert_runs_close(out["ZeRO1", plan_name], ddp_params, f"ZeRO1, {what}", **ADAM64)
            if plan_name == "units":
                assert_runs_close(out["ZeRO3", plan_name], ddp_params, f"ZeRO3, {what}", **ADAM64)
        ddp_grads, ddp_params = out["ddp", "no_sync"]
        assert_runs_close(out["BucketedDDP", "no_sync", 200], ddp_grads,
                          f"BucketedDDP, {where}, no_sync()", **F64)
        assert_runs_close(out["ZeRO2Adam", "no_sync", 200], ddp_params,
                          f"ZeRO2Adam, {where}, no_sync()", **ADAM64)


# ---------------------------------------------------------------- hooks across the rebuild

HOOK_STEPS = 4


def _gpt():
    from labkit.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=False))


def _hook_run(model, batches, me, group, hook=None, state=None, *, settle=None, cap_mb=1024):
    """A fresh DDP of ``model`` (one bucket by default, whose order the rebuild changes; several
    with a small ``cap_mb``) trained by SGD; ``hook`` registered at once, or after ``settle``
    plain iterations. Returns the gradients of every step, or the error a step raised."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(copy.deepcopy(model), process_group=group, bucket_cap_mb=cap_mb)
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
        grads.append(toy_grads(ddp.module))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


def _hooks(rank, world_size, group_size):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    from labkit.lab4.compression import CompressionState, compression_hook
    from labkit.lab4.powersgd import PowerSGDState, powersgd_hook
    from labkit.models import SyntheticData

    group, ranks = group_of(rank, world_size, group_size)
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
    # several buckets (the rebuild changes which parameters each holds): our hooks run them in
    # turn (torch's powerSGD_hook chains asynchronous all-reduces, which gloo may not match)
    options = dict(density=0.3, chunk=16, process_group=group)
    out["topk", "fresh, small buckets"] = _hook_run(
        model, batches, me, group, compression_hook, CompressionState("topk", **options), cap_mb=0.004)
    out["topk", "settled, small buckets"] = _hook_run(
        model, batches, me, group, compression_hook, CompressionState("topk", start_iter=1, **options),
        settle=1, cap_mb=0.004)
    out["powersgd", "small buckets"] = _hook_run(model, batches, me, group, powersgd_hook,
                                                 PowerSGDState(2, group), cap_mb=0.004)
    # gradient matrices that are exactly zero (a layer fed zeros): with torch's
    # orthogonalization_epsilon = 0 both hooks give NaN; with 1e-8, both the same finite values
    for eps in (0.0, 1e-8):
        theirs = torch_psgd.PowerSGDState(group, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                          min_compression_rate=1, use_error_feedback=True,
                                          warm_start=True, random_seed=0,
                                          orthogonalization_epsilon=eps)
        out["zero matrices", eps] = _zero_matrices_run(group, powersgd_hook, PowerSGDState(
            2, group, orthogonalization_epsilon=eps))
        out["zero matrices, torch", eps] = _zero_matrices_run(group, torch_psgd.powerSGD_hook, theirs)
    return out


def _zero_matrices_run(group, hook, state):
    """A fresh DDP of a linear layer fed zeros (its weight's gradient: exactly 0) before
    another: the gradients of 4 steps under ``hook``."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 4))
    ddp = DistributedDataParallel(model, process_group=group)
    ddp.register_comm_hook(state, hook)
    grads = []
    for _ in range(HOOK_STEPS):
        ddp(torch.zeros(3, 8)).square().mean().backward()
        grads.append(toy_grads(model))
        model.zero_grad(set_to_none=True)
    return grads


@functools.lru_cache(maxsize=None)
def hook_results(config):
    from labkit.ranks import launch

    world_size, group_size = CONFIGS[config]
    return launch(_hooks, world_size, group_size, timeout=180)


@pytest.mark.parametrize("config", ["N=1", "N=2", "two groups of 2"])
def test_hooks_on_a_fresh_ddp_survive_its_bucket_rebuild(config):
    """Hooks registered on a fresh DDP (one bucket, reordered by the rebuild after the first
    iteration): powersgd_hook equals torch's powerSGD_hook (start_powerSGD_iter=2) at every
    step; compression_hook equals itself started on a DDP that had already rebuilt (and so with
    several buckets, where powersgd_hook runs too); with start_iter=0 both are refused by name
    when the rebuild moves their buckets."""
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
        assert not isinstance(out["powersgd", "small buckets"], str), (
            f"{where}: powersgd_hook on a fresh DDP with several buckets raised "
            f"{out['powersgd', 'small buckets']}")
        for eps in (0.0, 1e-8):
            ours, theirs = out["zero matrices", eps], out["zero matrices, torch", eps]
            for s, (g, w) in enumerate(zip(ours, theirs)):
                for name, value in w.items():
                    torch.testing.assert_close(g[name], value, **HOOK_TOL, equal_nan=True,
                                               msg=lambda m, s=s, name=name, eps=eps: (
                        f"{where}: powersgd_hook with orthogonalization_epsilon={eps} on a gradient "
                        f"that is exactly zero: {name} at step {s + 1} differs from torch's: {m}"))
            if eps:
                assert all(torch.isfinite(v).all() for step in ours for v in step.values()), (
                    f"{where}: powersgd_hook with orthogonalization_epsilon={eps} gave a non-finite "
                    "gradient for a zero gradient matrix")
        for scheme, fresh_label, settled_label in (
                *[(s, "fresh", "settled") for s in ("int8", "topk", "randomk")],
                ("topk", "fresh, small buckets", "settled, small buckets")):
            fresh, settled = out[scheme, fresh_label], out[scheme, settled_label]
            assert not isinstance(fresh, str), f"{where}: {scheme} on a fresh DDP raised {fresh}"
            for s, (g, w) in enumerate(zip(fresh, settled)):
                for name, value in w.items():
                    assert torch.equal(g[name], value), (
                        f"{where}: compression_hook ({scheme}) on a fresh DDP gives {name} at step "
                        f"{s + 1} unlike the same hook started after the rebuild: is its state kept "
                        "from the first iteration (before DDP rebuilt its buckets)?")


# ---------------------------------------------------------------- edge cases
#
# Small models where the toy cannot reach: fewer elements than ranks (ZeRO shards of size 0 on
# some ranks, and a root unit with no parameters of its own), tied weights (GPT's wte/lm_head),
# BatchNorm buffers, gradients exactly zero; on a world of 1, of 3, and on the non-consecutive
# subgroup {0, 2} of 3 (rank 1 outside it). Each against DDP + Adam on the same ranks and data.

class _Tiny(torch.nn.Module):
    """Two elements in all (fewer than the ranks), every one inside the block ``h.0``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.h = torch.nn.ModuleList([torch.nn.Linear(1, 1)])

    def forward(self, x):
        return self.h[0](x).square().mean()


class _Tied(torch.nn.Module):
    """An embedding whose weight is also the output layer's (GPT's wte / lm_head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte = torch.nn.Embedding(5, 3)
        self.h = torch.nn.ModuleList([torch.nn.Linear(3, 3)])
        self.lm_head = torch.nn.Linear(3, 5, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x):
        return self.lm_head(self.h[0](self.wte(x))).square().mean()


class _Norm(torch.nn.Module):
    """A BatchNorm (running-statistics buffers) after a bias-free linear layer, its output
    pulled towards 0.5: no gradient here is 0 in exact arithmetic (a linear bias before the
    norm, or a target of 0 for the norm's bias, would be, leaving rounding noise that Adam's
    division by √v + ε amplifies differently in each summation order)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.h = torch.nn.ModuleList([torch.nn.Linear(3, 4, bias=False), torch.nn.BatchNorm1d(4)])

    def forward(self, x):
        return (self.h[1](self.h[0](x)) - 0.5).square().mean()


EDGE_MODELS = {"fewer elements than ranks": _Tiny, "tied weights": _Tied, "BatchNorm buffers": _Norm,
               "zero gradients": _Tiny}
EDGE_CONFIGS = {"N=1": (1, None), "N=3": (3, None), "subgroup {0, 2} of 3": (3, [0, 2])}
EDGE_WRAPPERS = ("ddp", "BucketedDDP", "ZeRO1", "ZeRO2Adam", "ZeRO3")
EDGE_STEPS = 3


def _edge_batch(kind, me, step):
    gen = torch.Generator().manual_seed(10 * step + me)
    if kind == "tied weights":
        return torch.randint(0, 5, (4,), generator=gen)
    if kind == "zero gradients":  # x = 0 and a zero weight: the loss is b², its gradients 2b·0
        return torch.zeros(4, 1, dtype=torch.float64)
    width = 1 if kind == "fewer elements than ranks" else 3
    return torch.randn(6, width, generator=gen, dtype=torch.float64)


def _edge_model(kind):
    model = EDGE_MODELS[kind]().double()
    if kind == "zero gradients":
        with torch.no_grad():
            model.h[0].weight.zero_()
            model.h[0].bias.zero_()  # d(b²)/db = 0 at b = 0, and dL/dw = 2b·x = 0
    return model


def _edge_run(wrapper, kind, me, group, cap):
    """``wrapper`` (+ Adam) on ``kind``'s model: per step the parameters; the buffers after
    the first step."""
    from torch.nn.parallel import DistributedDataParallel

    from labkit.lab4.bucketed_ddp import BucketedDDP

    model = _edge_model(kind)
    forward, finish = model, None
    if wrapper == "ddp":
        forward = DistributedDataParallel(model, process_group=group)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    elif wrapper == "BucketedDDP":
        forward = BucketedDDP(model, bucket_cap_bytes=cap, group=group)
        finish, opt = forward.finish, torch.optim.Adam(model.parameters(), lr=LR)
    else:
        opt = zero_optimizer(wrapper, model, group, cap)
    params, buffers = [], None
    for s in range(EDGE_STEPS):
        forward(_edge_batch(kind, me, s)).backward()
        if finish is not None:
            finish()
        opt.step()
        opt.zero_grad()
        params.append(opt.full_parameters() if wrapper == "ZeRO3" else
                      [p.detach().clone() for p in model.parameters()])
        if buffers is None:
            buffers = [b.detach().clone() for b in model.buffers()]
    return params, buffers


def _edges(rank, world_size, ranks):
    group, ranks = group_of(rank, world_size, ranks)
    if rank not in ranks:
        return None  # outside the subgroup: it only took part in creating it
    me, out = ranks.index(rank), {"ranks": ranks}
    for kind in EDGE_MODELS:
        model = _edge_model(kind)
        # a bucket cap of exactly one parameter's bytes (the largest)
        cap = max(p.numel() * p.element_size() for p in model.parameters())
        for wrapper in EDGE_WRAPPERS:
            try:
                out[kind, wrapper] = _edge_run(wrapper, kind, me, group, cap)
            except Exception as exc:  # reported by the test, with the wrapper's name
                out[kind, wrapper] = f"{type(exc).__name__}: {exc}"
        local = _edge_model(kind)  # this rank alone: its own running statistics after step 1
        local(_edge_batch(kind, me, 0))
        out[kind, "local buffers"] = [b.detach().clone() for b in local.buffers()]
    return out


@functools.lru_cache(maxsize=None)
def edge_results(config):
    from labkit.ranks import launch

    world_size, ranks = EDGE_CONFIGS[config]
    return launch(_edges, world_size, ranks, timeout=180)


@pytest.mark.parametrize("config", EDGE_CONFIGS)
def test_edge_cases_equal_ddp(config):
    """On a world of 1, of 3 and on the subgroup {0, 2} of 3: a model with fewer elements than
    ranks (ZeRO shards of size 0 on some ranks; no parameter outside its block), tied weights,
    a BatchNorm, gradients exactly zero; a bucket cap of exactly one parameter's bytes: every
    wrapper's parameters after each Adam step equal DDP + Adam's. Buffers: DDP broadcasts rank
    0's before each forward; the wrappers do not (a documented deviation): each rank keeps the
    running statistics of its own batches."""
    for rank, out in enumerate(edge_results(config)):
        if out is None:
            continue
        where = f"{config}, rank {rank} (group {out['ranks']})"
        for kind in EDGE_MODELS:
            want, ddp_buffers = out[kind, "ddp"]
            for wrapper in EDGE_WRAPPERS[1:]:
                got = out[kind, wrapper]
                assert not isinstance(got, str), f"{wrapper}, {where}, {kind}: raised {got}"
                params, buffers = got
                for s, (g, w) in enumerate(zip(params, want)):
                    for i, (a, b) in enumerate(zip(g, w)):
                        torch.testing.assert_close(a, b, **ADAM64, msg=lambda m, s=s, i=i, wrapper=wrapper, kind=kind: (
                            f"{wrapper}, {where}, {kind}: parameter {i} after step {s + 1} differs "
                            f"from DDP + Adam's: {m}"))
                for i, (a, b) in enumerate(zip(buffers, out[kind, "local buffers"])):
                    assert torch.equal(a, b), (
                        f"{wrapper}, {where}, {kind}: buffer {i} after step 1 is not this rank's own "
                        "running statistic (the wrappers do not broadcast buffers, as documented)")


@pytest.mark.parametrize("group", [[0, 1], "gloo", 0], ids=["a list of ranks", "a backend name", "an int"])
def test_a_group_that_is_no_process_group_is_refused_by_name(group):
    """``group=`` takes None or a ``torch.distributed.ProcessGroup`` (``dist.new_group(ranks)``):
    anything else is a TypeError naming ``group`` before any process group is touched (it was an
    AttributeError inside torch.distributed). No launch: the check comes first."""
    from labkit.lab2.zero1 import ZeRO1
    from labkit.lab3.zero3 import ZeRO3
    from labkit.lab4.bucketed_ddp import BucketedDDP
    from labkit.lab4.zero2 import ZeRO2Adam
    from labkit.models import GPT, GPTConfig

    lin = torch.nn.Linear(2, 2)
    gpt = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=4))
    for build in (lambda: ZeRO1(lin.parameters(), torch.optim.Adam, group=group),
                  lambda: ZeRO2Adam(lin.parameters(), group=group),
                  lambda: ZeRO3(gpt, group=group),
                  lambda: BucketedDDP(lin, group=group)):
        with pytest.raises(TypeError, match="group must be None .* or a torch.distributed.ProcessGroup"):
            build()
