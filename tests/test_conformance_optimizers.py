"""Conformance of every optimizer the course builds: one battery, run against ``torch.optim``.

In the spirit of PyTorch's own ``OptimizerInfo`` / ``optim_db`` tests: every optimizer is
registered once in ``REGISTRY`` (a test fails when a lab module defines an optimizer — a class
with ``zero_grad`` that is not a module — that is not registered, so a new one cannot skip the
battery), with what it promises to equal and its documented deviations. The battery, for each:

* **its reference, in each dtype**: fp64 and fp32 parameters trained exactly as the reference
  trains them; 16-bit parameters through an fp32 master (the reference: the torch optimizer on
  an fp32 copy, the parameter its rounding) — or a clear refusal naming the dtype;
* **a parameter without a gradient** is not stepped and its step count does not advance: a
  parameter first used at step k moves from then on exactly as under a fresh optimizer started
  at step k (its bias correction counts its own steps); frozen parameters never move;
* **parameter groups** with their own options equal one optimizer per group (and the reference
  with the same groups) — or a clear refusal;
* **several backwards before one step** equal one step on the summed gradient;
* **state_dict → load_state_dict → step** equals never having stopped (bit for bit);
* **zero_grad()** discards every gradient since the last step, and
  ``zero_grad(set_to_none=False)`` leaves a zero gradient wherever there was one, which the next
  step applies as torch's does; **step(closure)** calls the closure with gradients enabled and
  returns its loss;
* **edge cases**: a 0-dim, an empty, a 3-D and a non-contiguous parameter (a transposed view);
  gradients exactly zero, and ``step()`` with no gradient at all; the lr changed through
  ``param_groups`` between steps and ``StepLR`` (on the optimizer, or on the torch optimizer it
  runs, ``.optim``); options it lacks (``maximize``, ``amsgrad``, ``foreach``) refused by name,
  as keyword or group option; ``add_param_group`` after construction; a tensor listed twice is
  one parameter, one in two groups is refused; ``state_dict()`` after 0 or 2 steps round-trips
  bit for bit in every dtype;
  ``requires_grad`` switched off (the parameter stops) and on (trained as torch's optimizer
  trains it, or refused by name) during training; the reference's own ``state_dict`` loaded
  where the state layout is torch's, else refused by a ``ValueError``; options at the edges
  of what torch accepts (β = 0, ε = 0, lr = 0, weight decay...) as the reference, or refused
  by name;
* the distributed ones (ZeRO-1, ZeRO-2, ZeRO-3) inside real gloo ranks, on the world (4 ranks)
  and on two subgroups of 2, against ``DistributedDataParallel(find_unused_parameters=True)`` +
  ``torch.optim.Adam`` (a parameter used on some ranks only gets the average with zeros; one
  used on none is skipped), written plainly (``tests/_conformance_helpers.py``); and on 2
  ranks their edge cases: the lr changed by hand and by ``StepLR`` (on ``.optim``, the torch
  optimizer each runs), a ``state_dict`` from before any step, a parameter unfrozen during
  training (refused by name: their layout is fixed at construction).

The gradients come from backward through a toy model whose loss is linear in its parameters
(``tests/_conformance_helpers.py``): each parameter's gradient is exactly what the test chose,
so every reference is computed without a model.

What each optimizer conforms to, and its documented deviations:

* ``Adafactor`` (2.1) — ``torch.optim.Adafactor``, in every dtype (its state in the parameter's
  dtype, as torch's).
* ``Adam8bit`` (2.3) — ``torch.optim.Adam`` up to the 8-bit rounding of its moments.
  Deviation: Adam8bit keeps its moments as 8-bit codes: compared with Adam at a tolerance of the
  rounding, and with itself exactly. Deviation: Adam8bit updates a 16-bit parameter in its own
  dtype (no fp32 master), as bitsandbytes does.
* ``CAME`` (2.8) — the paper's Algorithm 1 (its grader has the plain computation).
  Deviation: CAME has no torch reference: the battery checks it against itself (one optimizer
  per group, a fresh optimizer for a late parameter, the summed gradient). Deviation: CAME
  updates a 16-bit parameter in its own dtype (fp32 state, no master).
* ``LOMO`` (2.4) — ``torch.optim.SGD``. Deviation: LOMO has no step(): each backward is an SGD
  step, so several backwards are several steps and there is no closure. Deviation: LOMO keeps
  no state: a new LOMO on the same parameters continues exactly. Deviation: LOMO has no lr
  scheduler: it is no ``torch.optim.Optimizer`` and holds none; each group's lr is fixed at
  construction.
* ``ZeRO1`` (2.5) — DDP + the wrapped ``torch.optim`` optimizer (Adam here; AdamW, SGD with
  Nesterov momentum and centered RMSprop in the edge cases). Deviation: ZeRO1 wraps elementwise
  optimizers only (each rank updates a flat slice): Adafactor, LBFGS and Muon are refused by
  name. Deviation: the state_dict
  of a ZeRO wrapper is its rank's: resume on the same ranks.
* ``ZeROOffload`` (2.6) — ``torch.optim.Adam`` on a master copy in host memory. Deviation:
  ZeROOffload takes a model: one set of options, no parameter groups.
* ``NVMeAdam`` (2.7) — ``torch.optim.Adam``. Deviation: NVMeAdam's checkpoint is its directory:
  a new NVMeAdam on it resumes (no state_dict). Deviation: NVMeAdam has no lr scheduler: it is
  no ``torch.optim.Optimizer`` (no ``param_groups``); each group's lr is fixed at construction.
* ``MixedPrecisionAdam`` (3.2) — ``torch.optim.Adam`` on an fp32 master. Deviation:
  MixedPrecisionAdam refuses fp32 and fp64 parameters (it exists for 16-bit ones).
* ``ZeRO3`` (3.7) — DDP + ``torch.optim.Adam``. Deviation: ZeRO3 takes a model: one set of
  options, no parameter groups. Deviation: ZeRO3 needs every rank to run the same units (FSDP's
  rule: the forward's all-gathers are collectives); a parameter used on some ranks only inside
  a unit that runs everywhere is handled as DDP handles it.
* ``ZeRO2Adam`` (4.3) — DDP + ``torch.optim.Adam``. Deviation: ZeRO2Adam takes its gradients
  from backward (hooks), not from a .grad set by hand.

Tolerances: against a reference, fp64 at rtol 1e-9 / atol 1e-12 (the same formula with
reductions in another order: ulps of 1e-16), fp32 at rtol 1e-5 / atol 1e-6 (a few ulps of
parameters of order 1), 16-bit at one bf16 ulp (rtol 2⁻⁷, and atol 2⁻⁸: one ulp of the
operands below 1, where a step that cancels most of a parameter leaves their rounding).
Self-consistency (the same code on the same values) is compared at fp64's 1e-12, checkpoints
bit for bit. Adam8bit against Adam: see ``ADAM8BIT_TOL``.
"""
from __future__ import annotations

import copy
import functools
import importlib
import inspect
import pkgutil
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from _conformance_helpers import (ADAM64, ALL, Toy, assert_histories_close, dp_plans, gradients, group_of,
                                  plan_of, reference_run, run, with_zeros)

F64 = dict(rtol=1e-9, atol=1e-12)
F32 = dict(rtol=1e-5, atol=1e-6)
B16 = dict(rtol=2 ** -7, atol=2 ** -8)
SAME = dict(rtol=1e-10, atol=1e-12)
LR = 0.05
# 8-bit moments: each step's update lr·m̂/(√v̂+ε) is off by the relative rounding of the codes,
# at most ~2% of lr per step for the dynamic code near the block's absmax; 3 steps: 3·0.02·lr.
ADAM8BIT_TOL = dict(rtol=0, atol=3 * 0.02 * LR)


@dataclass(frozen=True)
class OptimizerInfo:
    """One registered optimizer: how to build it, what it conforms to, how it deviates."""
    name: str  # the class name, as the lab module defines it
    exercise: str
    build: Callable  # build(model, params_or_groups, ctx) -> optimizer
    reference: Callable | None  # reference(params_or_groups) -> torch optimizer, same options
    dtypes: dict  # dtype -> "reference" | "master" | "refused"
    group_options: dict | None = None  # a second group's options; None: no groups (a model)
    accumulates: bool = True  # False: each backward is a step (LOMO)
    checkpoint: str = "state_dict"  # | "directory" | "stateless"
    distributed: bool = False
    has_closure: bool = True
    tol32: dict = field(default_factory=lambda: F32)
    deviations: tuple[str, ...] = ()


def _lab(module: str):
    return importlib.import_module(f"labkit.{module}")


class _Fused:
    """LOMO behind an optimizer's face: ``step`` has nothing to do (backward stepped)."""

    def __init__(self, lomo):
        self.lomo = lomo

    def step(self, closure=None):
        return None if closure is None else closure()

    def zero_grad(self, set_to_none: bool = True):
        self.lomo.zero_grad(set_to_none)


REGISTRY = [
    OptimizerInfo(
        "Adafactor", "2.1",
        build=lambda m, ps, ctx: _lab("lab2.adafactor").Adafactor(ps, lr=LR),
        reference=lambda ps: torch.optim.Adafactor(ps, lr=LR),
        dtypes={torch.float64: "reference", torch.float32: "reference", torch.bfloat16: "reference"},
        group_options=dict(lr=0.02, beta2_decay=-0.6, weight_decay=0.1),
        tol32=dict(rtol=1e-5, atol=1e-5)),  # RMS and norms reduced in another order
    OptimizerInfo(
        "Adam8bit", "2.3",
        build=lambda m, ps, ctx: _lab("lab2.adam8bit").Adam8bit(ps, lr=LR),
        reference=lambda ps: torch.optim.Adam(ps, lr=LR),
        dtypes={torch.float64: "reference", torch.float32: "reference", torch.bfloat16: "reference"},
        group_options=dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6),
        tol32=ADAM8BIT_TOL,
        deviations=("Adam8bit keeps its moments as 8-bit codes",
                    "Adam8bit updates a 16-bit parameter in its own dtype")),
    OptimizerInfo(
        "CAME", "2.8",
        build=lambda m, ps, ctx: _lab("lab2.came").CAME(ps, lr=LR),
        reference=None,
        dtypes={torch.float64: "self", torch.float32: "self", torch.bfloat16: "self"},
        group_options=dict(lr=0.02, betas=(0.8, 0.99, 0.999), weight_decay=0.1),
        deviations=("CAME has no torch reference", "CAME updates a 16-bit parameter in its own dtype")),
    OptimizerInfo(
        "LOMO", "2.4",
        build=lambda m, ps, ctx: _Fused(_lab("lab2.lomo").LOMO(ps, lr=LR)),
        reference=lambda ps: torch.optim.SGD(ps, lr=LR),
        dtypes={torch.float64: "reference", torch.float32: "reference", torch.bfloat16: "reference"},
        group_options=dict(lr=0.02), accumulates=False, checkpoint="stateless", has_closure=False,
        deviations=("LOMO has no step()", "LOMO keeps no state", "LOMO has no lr scheduler")),
    OptimizerInfo(
        "ZeRO1", "2.5",
        build=lambda m, ps, ctx: _lab("lab2.zero1").ZeRO1(ps, torch.optim.Adam, group=ctx.group, lr=LR),
        reference=lambda ps: torch.optim.Adam(ps, lr=LR),
        dtypes={torch.float64: "reference", torch.float32: "reference", torch.bfloat16: "master"},
        group_options=dict(lr=0.02, betas=(0.8, 0.99), weight_decay=0.1), distributed=True,
        deviations=("ZeRO1 wraps elementwise optimizers only",
                    "the state_dict of a ZeRO wrapper is its rank's")),
    OptimizerInfo(
        "ZeROOffload", "2.6",
        build=lambda m, ps, ctx: _lab("lab2.zero_offload").ZeROOffload(m, lr=LR),
        reference=lambda ps: torch.optim.Adam(ps, lr=LR),
        dtypes={torch.float64: "reference", torch.float32: "reference", torch.bfloat16: "master"},
        deviations=("ZeROOffload takes a model",)),
    OptimizerInfo(
        "NVMeAdam", "2.7",
        build=lambda m, ps, ctx: _lab("lab2.nvme_offload").NVMeAdam(ps, ctx.directory, lr=LR),
        reference=lambda ps: torch.optim.Adam(ps, lr=LR),
        dtypes={torch.float64: "reference", torch.float32: "reference", torch.bfloat16: "master"},
        group_options=dict(lr=0.02, betas=(0.8, 0.99), weight_decay=0.1), checkpoint="directory",
        deviations=("NVMeAdam's checkpoint is its directory", "NVMeAdam has no lr scheduler")),
    OptimizerInfo(
        "MixedPrecisionAdam", "3.2",
        build=lambda m, ps, ctx: _lab("lab3.mixed_precision").MixedPrecisionAdam(ps, lr=LR),
        reference=lambda ps: torch.optim.Adam(ps, lr=LR),
        dtypes={torch.float64: "refused", torch.float32: "refused", torch.bfloat16: "master",
                torch.float16: "master"},
        group_options=dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6),
        deviations=("MixedPrecisionAdam refuses fp32 and fp64 parameters",)),
    OptimizerInfo(
        "ZeRO3", "3.7",
        build=lambda m, ps, ctx: _lab("lab3.zero3").ZeRO3(m, lr=LR, group=ctx.group),
        reference=lambda ps: torch.optim.Adam(ps, lr=LR),
        dtypes={torch.float64: "reference", torch.float32: "reference", torch.bfloat16: "master"},
        distributed=True,
        deviations=("ZeRO3 takes a model", "ZeRO3 needs every rank to run the same units",
                    "the state_dict of a ZeRO wrapper is its rank's")),
    OptimizerInfo(
        "ZeRO2Adam", "4.3",
        build=lambda m, ps, ctx: _lab("lab4.zero2").ZeRO2Adam(ps, lr=LR, group=ctx.group,
                                                              bucket_cap_bytes=64),
        reference=lambda ps: torch.optim.Adam(ps, lr=LR),
        dtypes={torch.float64: "reference", torch.float32: "reference", torch.bfloat16: "master"},
        group_options=dict(lr=0.02, betas=(0.8, 0.99), weight_decay=0.1), distributed=True,
        deviations=("ZeRO2Adam takes its gradients from backward",
                    "the state_dict of a ZeRO wrapper is its rank's")),
]
BY_NAME = {info.name: info for info in REGISTRY}
LOCAL = [i for i in REGISTRY if not i.distributed]
DISTRIBUTED = [i for i in REGISTRY if i.distributed]
ids = lambda info: info.name  # noqa: E731


# ---------------------------------------------------------------- the registry itself

def lab_optimizers() -> dict[str, str]:
    """Every optimizer a lab module defines: a class with ``zero_grad`` that is not a module."""
    found = {}
    for n in range(1, 8):
        pkg = importlib.import_module(f"labkit.lab{n}")
        for m in pkgutil.iter_modules(pkg.__path__):
            mod = importlib.import_module(f"labkit.lab{n}.{m.name}")
            for name, obj in vars(mod).items():
                if (inspect.isclass(obj) and obj.__module__ == mod.__name__
                        and hasattr(obj, "zero_grad") and not issubclass(obj, torch.nn.Module)):
                    found[name] = mod.__name__
    return found


def test_every_optimizer_of_the_labs_is_registered():
    """A new optimizer in a lab module cannot skip the battery: it must be in REGISTRY."""
    missing = sorted(set(lab_optimizers()) - set(BY_NAME))
    assert not missing, (f"optimizers {missing} are defined in the labs but not registered in "
                         "tests/test_conformance_optimizers.py's REGISTRY (with what they conform "
                         "to and their deviations)")


def test_every_deviation_is_named_in_the_docstring():
    doc = " ".join(__doc__.split())
    for info in REGISTRY:
        assert f"``{info.name}`` ({info.exercise})" in doc, info.name
        for text in info.deviations:
            assert text in doc, f"{info.name}'s deviation {text!r} is not in the module docstring"


# ---------------------------------------------------------------- the local battery

def _ctx(tmp_path, name="a"):
    return SimpleNamespace(directory=tmp_path / name, group=None)


def _trainable(model):
    return [p for p in model.parameters()]  # frozen ones included: an optimizer must skip them


def _train(info, model, G, ctx, *, groups=None, closure=False, junk=None, set_to_none=True):
    params = _trainable(model) if groups is None else groups(model)
    opt = info.build(model, params, ctx)
    return run(model, opt, G, closure=closure, junk=junk, set_to_none=set_to_none), opt


def _tol(info, dtype, kind):
    if kind == "master" or dtype in (torch.bfloat16, torch.float16):
        if info.name == "Adam8bit":  # both roundings at once
            return dict(rtol=B16["rtol"], atol=B16["atol"] + ADAM8BIT_TOL["atol"])
        return B16
    return F64 if dtype == torch.float64 and info.name != "Adam8bit" else info.tol32


def _cases(infos, kinds=("reference", "master", "refused", "self")):
    return [pytest.param(info, dtype, id=f"{info.name}-{str(dtype)[6:]}")
            for info in infos for dtype, kind in info.dtypes.items() if kind in kinds]


@pytest.mark.parametrize("info,dtype", _cases(LOCAL))
def test_conforms_to_its_reference_in_each_dtype(info, dtype, tmp_path):
    """Three steps of every trainable parameter against the reference in this dtype (fp32
    master for 16-bit parameters where the optimizer promises one), or a clear refusal."""
    kind = info.dtypes[dtype]
    model = Toy(dtype)
    if kind == "refused":
        with pytest.raises((ValueError, TypeError), match=str(dtype).split(".")[-1]):
            info.build(model, _trainable(model), _ctx(tmp_path))
        return
    G = gradients(plan_of(3), dtype)
    want = reference_run(model, info.reference, G, 1, master=kind == "master") if info.reference else None
    got, _ = _train(info, copy.deepcopy(model), G, _ctx(tmp_path))
    for s in got:
        for name, p in s.items():
            assert p.dtype == dtype, f"{info.name}: {name} became {p.dtype}, expected {dtype}"
            assert torch.isfinite(p.double()).all(), f"{info.name}: {name} is not finite"
    assert torch.equal(got[-1]["frozen"], model.frozen), f"{info.name} moved a frozen parameter"
    if want is not None:
        assert_histories_close(got, want, f"{info.name} in {dtype} vs {kind}", **_tol(info, dtype, kind))


@pytest.mark.parametrize("info", LOCAL, ids=ids)
def test_a_parameter_without_gradient_is_skipped_and_counts_its_own_steps(info, tmp_path):
    """Block h.1 gets no gradient at step 1 (its block does not even run), then one at steps 2
    and 3: it must not move at step 1, and from then on move exactly as under a fresh optimizer
    that starts at step 2 (its bias correction counts its own steps, not the optimizer's). And
    a gap once it has state: gradients at steps 1, 3 and 4, none at step 2 — it must not move at
    step 2 (no step with its old moments), and its count stops there, as the reference's does
    and, where it keeps one, its ``state["step"]`` says (3 against the others' 4)."""
    dtype = _own_dtype(info)
    plan = plan_of(3)
    plan[0] = [[set(ALL) - {"h.1.weight", "h.1.bias"}]]
    G = gradients(plan, dtype)
    model = Toy(dtype)
    got, _ = _train(info, copy.deepcopy(model), G, _ctx(tmp_path, "late"))
    for name in ("h.1.weight", "h.1.bias"):
        assert torch.equal(got[0][name], dict(model.named_parameters())[name]), (
            f"{info.name} moved {name} at a step where it had no gradient")
    fresh, _ = _train(info, copy.deepcopy(model), G[1:], _ctx(tmp_path, "fresh"))
    for s in range(2):
        for name in ("h.1.weight", "h.1.bias"):
            torch.testing.assert_close(got[s + 1][name], fresh[s][name], **SAME, msg=lambda m, s=s, name=name: (
                f"{info.name}: {name} first used at step 2, after step {s + 2}, differs from a fresh "
                f"optimizer's (does its step count advance while it has no gradient?): {m}"))
    if info.reference is not None:
        want = reference_run(model, info.reference, G, 1, master=info.dtypes[dtype] == "master")
        assert_histories_close(got, want, f"{info.name}, a parameter first used at step 2",
                               **_tol(info, dtype, info.dtypes[dtype]))
    gap = plan_of(4)
    gap[1] = [[set(ALL) - {"h.1.weight", "h.1.bias"}]]
    G = gradients(gap, dtype)
    trained = copy.deepcopy(model)
    got, opt = _train(info, trained, G, _ctx(tmp_path, "gap"))
    # where it keeps torch's per-parameter state["step"] (not LOMO, nor the offloading ones,
    # whose torch optimizer on the host masters keeps it): the steps each had a gradient at,
    # exactly (exercise 2.8's graders once missed a count that never advanced)
    state = getattr(opt, "state", None) or {}
    for name, p in trained.named_parameters():
        if "step" in state.get(p, {}):
            want_steps = 3 if name.startswith("h.1.") else 4
            assert float(state[p]["step"]) == want_steps, (
                f"{info.name}: state['step'] of {name} is {state[p]['step']!r} after 4 steps, "
                f"expected {want_steps} (the steps at which it had a gradient)")
    for name in ("h.1.weight", "h.1.bias"):
        assert torch.equal(got[1][name], got[0][name]), (
            f"{info.name} moved {name} at step 2, where it had no gradient (after one at step 1): "
            "a parameter without a gradient is skipped, whatever state it has")
    if info.reference is not None:
        want = reference_run(model, info.reference, G, 1, master=info.dtypes[dtype] == "master")
        assert_histories_close(got, want, f"{info.name}, a parameter with no gradient at step 2 "
                               "only (does its step count advance in the gap?)",
                               **_tol(info, dtype, info.dtypes[dtype]))


def _own_dtype(info):
    """fp64 where the optimizer trains it like its reference (exact comparisons), else bf16."""
    return torch.float64 if info.dtypes.get(torch.float64) in ("reference", "self") else torch.bfloat16


def _split_groups(info):
    first = ["h.0.weight", "h.0.bias", "head"]

    def groups(model):
        named = dict(model.named_parameters())
        return [{"params": [named[n] for n in first]},
                {"params": [named["h.1.weight"], named["h.1.bias"], named["frozen"]],
                 **info.group_options}]
    return first, groups


@pytest.mark.parametrize("info", [i for i in LOCAL if i.group_options is not None], ids=ids)
def test_parameter_groups_apply_their_own_options(info, tmp_path):
    """Two groups, the second with its own options: equal to one optimizer per group (and to the
    reference with the same groups)."""
    dtype = _own_dtype(info)
    first, groups = _split_groups(info)
    G = gradients(plan_of(3), dtype)
    model = Toy(dtype)
    got, _ = _train(info, copy.deepcopy(model), G, _ctx(tmp_path, "g"), groups=groups)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    named_a, named_b = dict(a.named_parameters()), dict(b.named_parameters())
    alone_a, _ = _train(info, a, G, _ctx(tmp_path, "a"), groups=lambda m: [named_a[n] for n in first])
    second = [named_b["h.1.weight"], named_b["h.1.bias"]]
    opt_b = _build_with(info, b, second, info.group_options, _ctx(tmp_path, "b"))
    alone_b = run(b, opt_b, G)
    for s in range(3):
        for name in first:
            torch.testing.assert_close(got[s][name], alone_a[s][name], **SAME)
        for name in ("h.1.weight", "h.1.bias"):
            torch.testing.assert_close(got[s][name], alone_b[s][name], **SAME, msg=lambda m, name=name: (
                f"{info.name}: {name} in a group with its own options {info.group_options} moved "
                f"unlike an optimizer built with those options: {m}"))
    if info.reference is not None:
        want = reference_run(model, info.reference, G, 1, master=info.dtypes[dtype] == "master",
                             groups=[(first, {}), (["h.1.weight", "h.1.bias"], info.group_options)])
        assert_histories_close(got, want, f"{info.name} with two groups", **_tol(info, dtype, info.dtypes[dtype]))


def _build_with(info, model, params, options, ctx):
    """``info``'s optimizer over ``params`` with ``options`` instead of the battery's defaults."""
    return info.build(model, [{"params": params, **options}], ctx)


@pytest.mark.parametrize("info", LOCAL, ids=ids)
def test_several_backwards_before_a_step_add_up(info, tmp_path):
    """Two backwards before each step (the second through part of the model) equal one backward
    of the summed gradient; LOMO, whose backward is the step, makes two steps."""
    dtype = _own_dtype(info)
    plan = [[[set(ALL), {"h.0.weight", "head"}]] for _ in range(2)]
    G = gradients(plan, dtype)
    summed = [[[{n: sum(bw[n].double() for bw in step[0] if n in bw).to(dtype) for n in ALL}]]
              for step in G]
    model = Toy(dtype)
    got, _ = _train(info, copy.deepcopy(model), G, _ctx(tmp_path, "two"))
    if not info.accumulates:
        split = [[[bw]] for step in G for bw in step[0]]
        want, _ = _train(info, copy.deepcopy(model), split, _ctx(tmp_path, "split"))
        want = want[1::2]
    else:
        want, _ = _train(info, copy.deepcopy(model), summed, _ctx(tmp_path, "one"))
    assert_histories_close(got, want, f"{info.name}, two backwards per step", **SAME)


@pytest.mark.parametrize("info", LOCAL, ids=ids)
def test_state_dict_round_trip_resumes_exactly(info, tmp_path):
    """Two steps, a checkpoint (state_dict → a new optimizer on a copy of the model →
    load_state_dict; NVMeAdam: a new one on its directory; LOMO: a new one), one more step:
    bit for bit what three uninterrupted steps give."""
    dtype = _own_dtype(info)
    G = gradients(plan_of(3), dtype)
    model = Toy(dtype)
    straight, _ = _train(info, copy.deepcopy(model), G, _ctx(tmp_path, "straight"))
    first = copy.deepcopy(model)
    _, opt = _train(info, first, G[:2], _ctx(tmp_path, "resumed"))
    second = copy.deepcopy(model)  # a new model holding what the first one learned (no hooks)
    with torch.no_grad():
        for p, q in zip(second.parameters(), first.parameters()):
            p.copy_(q)
    if info.checkpoint == "state_dict":
        saved = copy.deepcopy(opt.state_dict())
        again = info.build(second, _trainable(second), _ctx(tmp_path, "unused"))
        again.load_state_dict(saved)
    else:  # a new one on the same directory (NVMe) or with no state at all (LOMO)
        if hasattr(opt, "close"):
            opt.close()
        again = info.build(second, _trainable(second), _ctx(tmp_path, "resumed"))
    resumed = run(second, again, G[2:])
    for name, want in straight[2].items():
        assert torch.equal(resumed[0][name], want), (
            f"{info.name}: {name} after a checkpoint and one step differs from never having "
            f"stopped (max |diff| {(resumed[0][name] - want).abs().max():.3g}): does "
            "load_state_dict keep every state tensor's dtype?")


@pytest.mark.parametrize("info", LOCAL, ids=ids)
def test_zero_grad_discards_and_step_calls_the_closure(info, tmp_path):
    """A backward whose gradients ``zero_grad()`` discards before each step changes nothing;
    ``step(closure)`` (where there is one) gives what backward then ``step()`` give, and returns
    the closure's loss; ``zero_grad(set_to_none=False)`` leaves every parameter a zero gradient
    that the next step applies, as torch's, even to a parameter the next backward misses."""
    dtype = _own_dtype(info)
    G = gradients(plan_of(2), dtype)
    junk = gradients(plan_of(2), dtype, seed=7)
    model = Toy(dtype)
    plain, _ = _train(info, copy.deepcopy(model), G, _ctx(tmp_path, "plain"))
    if info.accumulates:  # LOMO's junk backward would be a step: zero_grad cannot undo it
        cleared, _ = _train(info, copy.deepcopy(model), G, _ctx(tmp_path, "junk"), junk=junk)
        assert_histories_close(cleared, plain, f"{info.name}: gradients before zero_grad()", **SAME)
    if info.has_closure:
        closed, _ = _train(info, copy.deepcopy(model), G, _ctx(tmp_path, "closure"), closure=True)
        assert_histories_close(closed, plain, f"{info.name}: step(closure)", **SAME)
    # zero_grad(set_to_none=False) leaves a zero gradient, which torch's next step applies (its
    # step count advances), also to a parameter that the next backward does not reach
    partial = [[[set(ALL)]], [[set(ALL) - {"h.1.weight", "h.1.bias"}]], [[set(ALL) - {"head"}]]]
    G = gradients(partial, dtype)
    kept, _ = _train(info, copy.deepcopy(model), G, _ctx(tmp_path, "kept"), set_to_none=False)
    zeros, _ = _train(info, copy.deepcopy(model), with_zeros(G), _ctx(tmp_path, "zeros"))
    assert_histories_close(kept, zeros, f"{info.name}: zero_grad(set_to_none=False), then a "
                           "backward that misses some parameters (they keep a zero gradient)", **SAME)


# ---------------------------------------------------------------- the distributed battery

def _dp_plan(ranks):
    """The plan of ``tests/_conformance_helpers.dp_plans``' "units": no unit ever runs on some
    ranks only (ZeRO-3's rule)."""
    return dp_plans(ranks)["units"]


def _snapshot_run(info, model, opt, G, rank, **kwargs):
    snapshot = (lambda: _full(info, model, opt)) if info.name == "ZeRO3" else None
    return run(model, opt, G, rank, snapshot=snapshot, **kwargs)


def _full(info, model, opt):
    if info.name == "ZeRO3":
        return dict(zip([n for n, _ in model.named_parameters()], opt.full_parameters()))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _dp_battery(rank, world_size, name):
    """Inside each rank: the battery on the world and on this rank's subgroup of 2."""
    info = BY_NAME[name]
    out = {}
    for where, (group, ranks) in (("world", (None, list(range(world_size)))),
                                  ("subgroup", group_of(rank, world_size, 2))):
        me = ranks.index(rank)
        ctx = SimpleNamespace(group=group, directory=None)
        res = out[where] = {"ranks": ranks}
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            G = gradients(_dp_plan(world_size) if dtype == torch.float64 else plan_of(2, world_size),
                          dtype)
            G = [[step[r] for r in ranks] for step in G]  # this group's ranks' own data
            model = Toy(dtype)
            res[dtype] = _snapshot_run(info, model, info.build(model, list(model.parameters()), ctx), G, me)
        G = [[step[r] for r in ranks] for step in gradients(_dp_plan(world_size), torch.float64)]
        if info.group_options is not None:
            first, groups = _split_groups(info)
            model = Toy(torch.float64)
            res["groups"] = run(model, info.build(model, groups(model), ctx), G, me)
        model = Toy(torch.float64)
        res["junk"] = _snapshot_run(info, model, info.build(model, list(model.parameters()), ctx), G, me,
                                    junk=[[step[r] for r in ranks] for step in
                                          gradients(_dp_plan(world_size), torch.float64, seed=7)])
        model = Toy(torch.float64)
        res["closure"] = _snapshot_run(info, model, info.build(model, list(model.parameters()), ctx), G, me,
                                       closure=True)
        model = Toy(torch.float64)
        res["kept zeros"] = _snapshot_run(info, model, info.build(model, list(model.parameters()), ctx), G,
                                          me, set_to_none=False)
        model = Toy(torch.float64)
        res["explicit zeros"] = _snapshot_run(info, model, info.build(model, list(model.parameters()), ctx),
                                              with_zeros(G), me)
        model = Toy(torch.float64)  # a checkpoint after two steps, then two more
        opt = info.build(model, list(model.parameters()), ctx)
        _snapshot_run(info, model, opt, G[:2], me)
        saved, params = copy.deepcopy(opt.state_dict()), _full(info, model, opt)
        again = Toy(torch.float64)
        with torch.no_grad():
            for n, p in again.named_parameters():
                p.copy_(params[n])
        res["resumed"] = _snapshot_run(info, again, _loaded(info, again, ctx, saved), G[2:], me)
    return out


def _loaded(info, model, ctx, saved):
    opt = info.build(model, list(model.parameters()), ctx)
    opt.load_state_dict(saved)
    return opt


@functools.lru_cache(maxsize=None)
def dp_results(name):
    from labkit.ranks import launch

    return launch(_dp_battery, 4, name, timeout=180)


@pytest.mark.parametrize("info", DISTRIBUTED, ids=ids)
def test_distributed_optimizers_conform_on_the_world_and_on_subgroups(info):
    """ZeRO-1/2/3 on 4 ranks and on two subgroups of 2 ({0, 1} and {2, 3}, each on its own data):
    every rank's parameters after every step equal DDP(find_unused_parameters=True) + Adam —
    a parameter used on no rank skipped (step 1), one used on some ranks only averaged with
    zeros (step 2), several backwards added (step 3); in fp64 and fp32 as Adam trains them,
    in bf16 through an fp32 master; two parameter groups with their own options; gradients
    discarded by zero_grad(); zero_grad(set_to_none=False) keeping zero gradients (as explicit
    zero gradients); step(closure); a checkpoint resumed bit for bit."""
    results = dp_results(info.name)
    for rank, out in enumerate(results):
        for where, res in out.items():
            ranks = res["ranks"]
            what = f"{info.name}, rank {rank} on {where} {ranks}"
            for dtype in (torch.float64, torch.float32, torch.bfloat16):
                plan = _dp_plan(4) if dtype == torch.float64 else plan_of(2, 4)
                G = [[step[r] for r in ranks] for step in gradients(plan, dtype)]
                kind = info.dtypes[dtype]
                want = reference_run(Toy(dtype), info.reference, G, len(ranks), master=kind == "master")
                assert_histories_close(res[dtype], want, f"{what}, {dtype}", **_tol(info, dtype, kind))
            G = [[step[r] for r in ranks] for step in gradients(_dp_plan(4), torch.float64)]
            want = reference_run(Toy(torch.float64), info.reference, G, len(ranks))
            if "groups" in res:
                first, _ = _split_groups(info)
                grouped = reference_run(Toy(torch.float64), info.reference, G, len(ranks),
                                        groups=[(first, {}), (["h.1.weight", "h.1.bias"], info.group_options)])
                assert_histories_close(res["groups"], grouped, f"{what}, two groups", **F64)
            assert_histories_close(res["junk"], want, f"{what}, gradients before zero_grad()", **F64)
            assert_histories_close(res["closure"], want, f"{what}, step(closure)", **F64)
            assert_histories_close(res["kept zeros"], res["explicit zeros"],
                                   f"{what}, zero_grad(set_to_none=False) keeps zero gradients", **SAME)
            for name, w in res[torch.float64][3].items():
                assert torch.equal(res["resumed"][1][name], w), (
                    f"{what}: {name} after a checkpoint at step 2 and two more steps differs from "
                    f"never having stopped (max |diff| {(res['resumed'][1][name] - w).abs().max():.3g})")


# ---------------------------------------------------------------- edge cases (local)
#
# Each drives the optimizer on a few free-standing parameters (``_Params``: the loss is
# Σ p·G_p, so the gradients are again what the test chose) against its reference given the
# same gradients, or against itself where there is none (CAME).

class _Params(torch.nn.Module):
    """Free-standing parameters as a module (ZeROOffload and ZeRO3 take a model)."""

    def __init__(self, params):
        super().__init__()
        self.ps = torch.nn.ParameterList(params)

    def forward(self, grads):
        loss = sum(((p * g).sum() for p, g in zip(self.ps, grads) if g is not None), torch.zeros(()))
        return loss.to(self.ps[0].dtype)


def _param(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype))


def _grad(shape, dtype, seed):
    """A gradient in multiples of 1/64 (exact sums, as ``gradients``)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(shape, generator=gen) * 16).round().div(64).to(dtype)


def _holder(info, opt):
    """The ``torch.optim.Optimizer`` whose ``param_groups`` hold ``opt``'s options: ``opt``
    itself, or the torch optimizer it runs (``.optim``), or None (LOMO, NVMeAdam)."""
    for o in (opt, getattr(opt, "optim", None)):
        if isinstance(o, torch.optim.Optimizer):
            return o
    return None


def _drive(info, params, G, ctx, *, between=None, spec=None, setup=None):
    """``info``'s optimizer on ``params`` (or ``spec``: the groups): per step the backward of
    ``G[s]`` (one gradient or None per parameter), ``step()``, ``zero_grad()``, then
    ``between(opt, s)`` (``setup(opt)`` once, first). Returns the parameters after each step."""
    model = _Params(params)
    opt = info.build(model, list(params) if spec is None else spec, ctx)
    if setup is not None:
        setup(opt)
    history = []
    for s, grads in enumerate(G):
        if any(g is not None for g, p in zip(grads, params) if p.requires_grad):
            model([g if p.requires_grad else None for g, p in zip(grads, params)]).backward()
        opt.step()
        opt.zero_grad()
        if between is not None:
            between(opt, s)
        history.append([p.detach().clone() for p in params])
    return history, opt


def _reference_drive(info, params, G, *, between=None, spec=None, master=False, setup=None):
    """The reference (a ``torch.optim`` optimizer, fp32 master for 16-bit parameters where
    promised) given the same gradients."""
    held = [p.detach().float().clone().requires_grad_(p.requires_grad) if master else p for p in params]
    opt = info.reference(held if spec is None else spec(held))
    if setup is not None:
        setup(opt)
    history = []
    for s, grads in enumerate(G):
        for h, g in zip(held, grads):
            h.grad = None if g is None or not h.requires_grad else g.to(h.dtype).clone()
        opt.step()
        opt.zero_grad()
        if between is not None:
            between(opt, s)
        if master:
            with torch.no_grad():
                for p, h in zip(params, held):
                    p.copy_(h)
        history.append([p.detach().clone() for p in params])
    return history


def _copies(params):
    return [torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in params]


def _against_reference(info, params, G, what, tmp_path, *, between=None, spec=None, exclude=(),
                       where="got", setup=None):
    """``info`` on ``params`` against its reference (or, without one, nothing but finiteness);
    parameters in ``exclude`` (indices) are left out of the reference (torch refuses them)."""
    dtype = params[0].dtype
    kind = info.dtypes[dtype]
    got, opt = _drive(info, params, G, _ctx(tmp_path, where), between=between, setup=setup,
                      spec=None if spec is None else spec(params))
    for s in got:
        for i, p in enumerate(s):
            assert p.dtype == dtype and torch.isfinite(p.double()).all(), (
                f"{info.name}, {what}: parameter {i} after a step is {p.dtype} / not finite")
    if info.reference is not None:
        keep = [i for i in range(len(params)) if i not in exclude]
        fresh = _copies([params[i] for i in keep])
        with torch.no_grad():  # from the same start as got
            for f, i in zip(fresh, keep):
                f.copy_(_start[id(params[i])])
        want = _reference_drive(info, fresh, [[g[i] for i in keep] for g in G], between=between, setup=setup,
                                spec=spec, master=kind == "master")
        assert_histories_close([[s[i] for i in keep] for s in got], want, f"{info.name}, {what}",
                            **_tol(info, dtype, kind))
    return got, opt


_start: dict = {}


def _fresh_params(shapes, dtype, transposed=()):
    """Parameters of ``shapes`` (a shape in ``transposed`` is made as the transposed view of
    its transpose: a non-contiguous parameter); their starting values kept in ``_start``."""
    out = []
    for k, shape in enumerate(shapes):
        if k in transposed:
            p = torch.nn.Parameter(_param(shape[::-1], dtype, k).detach().t())
            assert not p.is_contiguous()
        else:
            p = _param(shape, dtype, k)
        _start[id(p)] = p.detach().clone()
        out.append(p)
    return out


def _random_grads(shapes, dtype, steps=3, missing=lambda s, k: False):
    return [[None if missing(s, k) else _grad(shape, dtype, 10 * s + k) for k, shape in enumerate(shapes)]
            for s in range(steps)]


ODD_SHAPES = [(), (0,), (2, 3, 4), (3, 4), (5,)]  # a scalar, an empty one, 3-D, (3, 4) transposed


@pytest.mark.parametrize("info,dtype", _cases(LOCAL, kinds=("reference", "master", "self")))
def test_scalar_empty_3d_and_non_contiguous_parameters(info, dtype, tmp_path):
    """A 0-dim parameter, one with no elements, a 3-D one and a non-contiguous one (the
    transposed view of a 4×3 tensor) trained with a vector, 3 steps: each as the reference
    trains it (torch.optim.Adafactor refuses an empty parameter: it is left out of the
    reference there, and must simply stay empty); the non-contiguous one as its contiguous
    copy is trained (at the reference's tolerance: reductions over another memory order); in
    every dtype the optimizer trains."""
    params = _fresh_params(ODD_SHAPES, dtype, transposed=(3,))
    G = _random_grads(ODD_SHAPES, dtype)
    exclude = (1,) if info.name == "Adafactor" else ()
    got, _ = _against_reference(info, params, G, "a scalar, an empty, a 3-D and a non-contiguous "
                                "parameter", tmp_path, exclude=exclude)
    assert got[-1][1].shape == (0,), f"{info.name}: the empty parameter changed shape"
    twin = _fresh_params([(3, 4)], dtype)
    with torch.no_grad():
        twin[0].copy_(_start[id(params[3])])
    alone, opt = _drive(info, twin, [[g[3]] for g in G], _ctx(tmp_path, "twin"))
    # an optimizer computing in fp32 (CAME's grad_dtype) rounds the reductions at fp32's ulps
    tol = info.tol32 if getattr(opt, "grad_dtype", None) == torch.float32 else _tol(
        info, dtype, info.dtypes[dtype])
    assert_histories_close([[s[3]] for s in got], alone, f"{info.name}: a non-contiguous parameter vs "
                        "its contiguous copy", **tol)


@pytest.mark.parametrize("info", LOCAL, ids=ids)
def test_zero_gradients_and_steps_without_any_gradient(info, tmp_path):
    """Gradients that are exactly zero (a step that counts: Adam's step count advances) and
    ``step()`` calls with no gradient at all (first, then in the middle of training: nothing
    moves, no count advances), against the reference given the same."""
    dtype = _own_dtype(info)
    shapes = [(3, 4), (5,)]
    for what, missing, zero in (("no gradient at all at step 1", lambda s, k: s == 0, False),
                                ("no gradient at all at step 2", lambda s, k: s == 1, False),
                                ("gradients exactly zero at step 2", lambda s, k: False, True)):
        params = _fresh_params(shapes, dtype)
        G = _random_grads(shapes, dtype, missing=missing)
        if zero:
            G[1] = [torch.zeros_like(g) for g in G[1]]
        got, _ = _against_reference(info, params, G, what, tmp_path, where=what)
        if not zero:
            for k in range(2):
                before = _start[id(params[k])] if what.endswith("1") else got[0][k]
                assert torch.equal(got[int(what.endswith("2"))][k], before), (
                    f"{info.name}: parameter {k} moved at a step() without any gradient")


@pytest.mark.parametrize("info", LOCAL, ids=ids)
def test_a_sparse_gradient_is_applied_as_sgd_or_refused_by_name(info, tmp_path):
    """A sparse gradient (``nn.Embedding(sparse=True)``): LOMO applies it as ``torch.optim.SGD``
    does (the rows looked up move by −lr·grad, the others stay); every other optimizer refuses
    it with an error naming sparse gradients, as ``torch.optim.Adam`` does, before any state
    changes — not a failure deep inside torch's kernels."""
    dtype = _own_dtype(info)
    emb = torch.nn.Embedding(6, 3, sparse=True).to(dtype)
    before = emb.weight.detach().clone()
    opt = info.build(emb, list(emb.parameters()), _ctx(tmp_path))
    rows = torch.tensor([1, 4])
    if info.name == "LOMO":
        emb(rows).sum().backward()
        want = before.clone()
        want[rows] -= LR
        assert torch.equal(emb.weight.detach(), want), "LOMO: a sparse gradient applied otherwise than SGD"
        return
    with pytest.raises(TypeError, match="does not support sparse gradients"):
        emb(rows).sum().backward()
        opt.step()
    assert torch.equal(emb.weight.detach(), before), f"{info.name}: a refused step moved the weights"


@pytest.mark.parametrize("info", [i for i in LOCAL if i.name != "LOMO"], ids=ids)
def test_a_complex_parameter_is_refused_by_name(info, tmp_path):
    """A complex parameter is refused when the optimizer is built, naming its dtype (their
    factored, 8-bit, fp32-master or host states hold real numbers: Adam8bit used to drop the
    imaginary part with only a warning, Adafactor failed inside torch). LOMO, SGD's update,
    trains one as torch.optim.SGD does."""
    p = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.complex64))
    with pytest.raises((TypeError, ValueError), match="complex|floating"):
        info.build(_Params([p]), [p], _ctx(tmp_path))

def _halve_lr(opt, s):
    for group in opt.param_groups:
        group["lr"] = group["lr"] * 0.5


@pytest.mark.parametrize("info", LOCAL, ids=ids)
def test_lr_changed_between_steps_and_a_scheduler(info, tmp_path):
    """The learning rate halved through ``param_groups`` after every step (the optimizer's
    own, or those of the torch optimizer it runs, ``.optim``), and ``StepLR(gamma=0.5)`` on
    that torch optimizer: equal to the reference driven the same way. LOMO and NVMeAdam hold
    no torch optimizer: a documented deviation (their lr is fixed at construction)."""
    dtype = _own_dtype(info)
    shapes = [(3, 4), (5,)]
    params = _fresh_params(shapes, dtype)
    probe = _holder(info, info.build(_Params(_copies(params)), _copies(params), _ctx(tmp_path, "probe")))
    if probe is None:
        assert f"{info.name} has no lr scheduler" in info.deviations, (
            f"{info.name} exposes no torch.optim.Optimizer (itself or .optim) whose param_groups "
            "a scheduler could change: a deviation to document")
        return
    G = _random_grads(shapes, dtype, steps=3)
    _against_reference(info, params, G, "lr halved through param_groups after each step", tmp_path,
                       between=lambda opt, s: _halve_lr(_holder(info, opt), s), where="halved")
    schedulers = {}  # id(optimizer) -> its StepLR (ours and the reference's)

    def schedule(opt):
        schedulers[id(opt)] = torch.optim.lr_scheduler.StepLR(_holder(info, opt), step_size=1, gamma=0.5)

    def scheduled(opt, s):
        schedulers[id(opt)].step()

    params = _fresh_params(shapes, dtype)
    got, opt = _against_reference(info, params, G, "StepLR(gamma=0.5)", tmp_path, between=scheduled,
                                  where="scheduled", setup=schedule)
    assert [g["lr"] for g in _holder(info, opt).param_groups] == [LR * 0.5 ** 3], (
        f"{info.name}: after 3 StepLR steps the lr is {[g['lr'] for g in _holder(info, opt).param_groups]}")


@pytest.mark.parametrize("info", LOCAL, ids=ids)
def test_options_it_does_not_have_are_refused_by_name(info, tmp_path):
    """Options torch's optimizers take but this one does not implement (``maximize``,
    ``amsgrad``, ``foreach``), as keyword arguments or in a param group: refused with an error
    naming the option, never silently ignored (torch's Adam would honour them)."""
    dtype = _own_dtype(info)
    for option in ("maximize", "amsgrad", "foreach"):
        params = _fresh_params([(3, 4)], dtype)
        if info.group_options is not None:
            with pytest.raises((ValueError, TypeError), match=option):
                info.build(_Params(params), [{"params": params, option: True}], _ctx(tmp_path, option))
        signature = inspect.signature(type(info.build(_Params(params), params, _ctx(tmp_path, "sig"))).__init__)
        assert option not in signature.parameters or option == "foreach", (
            f"{info.name} takes {option}: the battery should compare it with the reference")


@pytest.mark.parametrize("info", [i for i in LOCAL if i.group_options is not None], ids=ids)
def test_add_param_group_and_a_tensor_listed_twice(info, tmp_path):
    """``add_param_group`` after construction equals the two groups given at construction (on
    a ``torch.optim.Optimizer``; the others have no such method: a deviation); a tensor listed
    twice in a group is one parameter (one step per step, as a tied weight); a tensor in two
    groups is refused (torch raises too)."""
    dtype = _own_dtype(info)
    shapes = [(3, 4), (5,)]
    G = _random_grads(shapes, dtype)
    params = _fresh_params(shapes, dtype)
    later = _copies(params)
    both = [{"params": [params[0]]}, {"params": [params[1]], **info.group_options}]
    together, _ = _drive(info, params, G, _ctx(tmp_path, "together"), spec=both)
    model = _Params(later)
    opt = info.build(model, [{"params": [later[0]]}], _ctx(tmp_path, "later"))
    if isinstance(opt, torch.optim.Optimizer):
        opt.add_param_group({"params": [later[1]], **info.group_options})
        for grads in G:
            model(grads).backward()
            opt.step()
            opt.zero_grad()
        assert_histories_close([later], [together[-1]], f"{info.name}: add_param_group after "
                            "construction vs the same groups at construction", **SAME)
    else:
        assert f"{info.name} has no lr scheduler" in info.deviations, (
            f"{info.name} has no add_param_group: a deviation to document")
    once = _fresh_params(shapes, dtype)
    twice = _copies(once)
    a, _ = _drive(info, once, G, _ctx(tmp_path, "once"))
    b, _ = _drive(info, twice, G, _ctx(tmp_path, "twice"), spec=[twice[0], twice[0], twice[1]])
    assert_histories_close(b, a, f"{info.name}: a tensor listed twice (it must be stepped once per "
                        "step, as one parameter)", **SAME)
    p = _fresh_params(shapes, dtype)
    with pytest.raises(ValueError):
        info.build(_Params(p), [{"params": [p[0]]}, {"params": [p[0], p[1]], **info.group_options}],
                   _ctx(tmp_path, "two groups"))


@pytest.mark.parametrize("info,dtype", _cases([i for i in LOCAL if i.checkpoint == "state_dict"],
                                               kinds=("reference", "master", "self")))
@pytest.mark.parametrize("at", [0, 2])
def test_state_dict_round_trips_in_every_dtype(info, dtype, at, tmp_path):
    """state_dict() after 0 steps (nothing stepped yet) or 2, in every dtype the optimizer
    trains (16-bit ones with their fp32 state), loaded into a new optimizer on a model
    holding the same values, then the remaining steps: bit for bit what never stopping gives
    (the loader keeps every state tensor's dtype: an fp32 master or moment cast to bf16, or
    uint8 codes cast to floats, would not resume exactly)."""
    shapes = [(3, 4), (5,)]
    G = _random_grads(shapes, dtype, steps=4)
    params = _fresh_params(shapes, dtype)
    first = _copies(params)
    straight, _ = _drive(info, params, G, _ctx(tmp_path, "straight"))
    done, opt = _drive(info, first, G[:at], _ctx(tmp_path, "first"))
    saved = copy.deepcopy(opt.state_dict())
    again = _copies(first)
    model = _Params(again)
    opt = info.build(model, again, _ctx(tmp_path, "again"))
    opt.load_state_dict(saved)
    resumed = done
    for grads in G[at:]:
        model(grads).backward()
        opt.step()
        opt.zero_grad()
        resumed.append([p.detach().clone() for p in again])
    assert_histories_close(resumed, straight, f"{info.name} in {dtype}: state_dict() after {at} steps, "
                        "loaded into a new optimizer, then the rest", rtol=0, atol=0)


@pytest.mark.parametrize("info", LOCAL, ids=ids)
def test_requires_grad_switched_during_training(info, tmp_path):
    """A parameter frozen after step 1 (``requires_grad_(False)``) moves no more; one frozen at
    construction and unfrozen after step 1 is trained from then on as the reference trains it
    (torch's optimizers hold frozen parameters too) — or refused at the next step, naming
    requires_grad (an optimizer that only takes the parameters trainable when it is built)."""
    dtype = _own_dtype(info)
    if info.dtypes[dtype] == "refused":
        dtype = torch.bfloat16
    shapes = [(3, 4), (5,), (2, 2)]
    G = _random_grads(shapes, dtype)
    params = _fresh_params(shapes, dtype)
    params[2].requires_grad_(False)

    def switch(opt, s):
        if s == 0:
            params[1].requires_grad_(False)

    if isinstance(info.build(_Params(_copies(params)), _copies(params), _ctx(tmp_path, "probe")), _Fused):
        got, _ = _drive(info, params, G, _ctx(tmp_path, "got"), between=switch)
        assert torch.equal(got[0][1], got[2][1]), f"{info.name} moved a parameter frozen after step 1"
        return  # LOMO: its hooks are attached at construction (documented)
    model = _Params(params)
    opt = info.build(model, list(params), _ctx(tmp_path, "switched"))
    twins = _copies(params)
    ref = None if info.reference is None else info.reference(twins)
    for s, grads in enumerate(G):
        try:
            model([g if p.requires_grad else None for g, p in zip(grads, params)]).backward()
            opt.step()
        except (ValueError, RuntimeError) as exc:
            assert s == 1 and "requires_grad" in str(exc), (
                f"{info.name}: step {s + 1} raised {exc!r}; expected a refusal naming requires_grad "
                "only after a frozen parameter was unfrozen")
            return
        opt.zero_grad()
        if ref is not None and info.dtypes[dtype] == "reference":
            for t, p, g in zip(twins, params, grads):
                t.grad = g.clone() if p.requires_grad else None
            ref.step()
            ref.zero_grad()
            assert_histories_close([list(params)], [twins], f"{info.name}, step {s + 1}, requires_grad "
                                "switched (one frozen after step 1, one unfrozen)",
                                **_tol(info, dtype, "reference"))
        if s == 0:
            params[1].requires_grad_(False)
            params[2].requires_grad_(True)
            frozen_at = params[1].detach().clone()
            twins[1].requires_grad_(False)
            twins[2].requires_grad_(True)
    assert torch.equal(params[1].detach(), frozen_at), f"{info.name} moved a parameter frozen after step 1"
    assert not torch.equal(params[2].detach(), _start[id(params[2])]), (
        f"{info.name} silently ignored a parameter unfrozen after step 1 (its gradient was there): "
        "train it, or refuse naming requires_grad")


@pytest.mark.parametrize("info", [i for i in LOCAL if i.checkpoint == "state_dict" and i.reference], ids=ids)
def test_load_state_dict_of_its_reference(info, tmp_path):
    """The state_dict of the reference (torch's optimizer, after 2 steps) loaded into this one,
    then a third step: as the reference's third step where the state layout is torch's
    (Adafactor), else refused by a ValueError (never a KeyError or a silently wrong step)."""
    dtype = _own_dtype(info)
    if info.dtypes[dtype] != "reference":
        pytest.skip(f"{info.name} has no reference in {dtype}")
    shapes = [(3, 4), (5,)]
    G = _random_grads(shapes, dtype)
    params = _fresh_params(shapes, dtype)
    want = _reference_drive(info, _copies(params), G)
    theirs = _copies(params)
    ref = info.reference(theirs)
    for grads in G[:2]:
        for t, g in zip(theirs, grads):
            t.grad = g.clone()
        ref.step()
        ref.zero_grad()
    model = _Params(theirs)
    opt = info.build(model, theirs, _ctx(tmp_path, "loaded"))
    if info.name != "Adafactor":
        with pytest.raises(ValueError):
            opt.load_state_dict(copy.deepcopy(ref.state_dict()))
        return
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    model(G[2]).backward()
    opt.step()
    assert_histories_close([list(theirs)], [want[2]], f"{info.name}: torch's state_dict loaded, then a "
                        "step", **_tol(info, dtype, "reference"))


# ---------------------------------------------------------------- edge cases (distributed)

def _dp_edges(rank, world_size, name):
    """Inside each of 2 ranks, on the toy in fp64: the lr halved through ``param_groups`` (of
    the torch optimizer the wrapper runs) after each step; ``StepLR`` on it; the frozen
    parameter unfrozen after step 1 (trained from then on, or refused by name); a state_dict
    written before any step, loaded into a new wrapper; params given as a generator
    (``model.parameters()``), read once."""
    info = BY_NAME[name]
    ctx = SimpleNamespace(group=None, directory=None)
    G = gradients(plan_of(3, world_size), torch.float64)
    out = {}

    def drive(setup=None, between=None, unfreeze=False, opt_of=None):
        model = Toy(torch.float64)
        opt = info.build(model, list(model.parameters()), ctx) if opt_of is None else opt_of(model)
        if setup is not None:
            setup(opt)
        history = []
        for s, step in enumerate(G):
            try:
                _snapshot_run(info, model, opt, [step], rank)
            except (ValueError, RuntimeError) as exc:
                return f"{type(exc).__name__}: {exc}"
            if between is not None:
                between(opt, s)
            if unfreeze and s == 0:
                model.frozen.requires_grad_(True)
            history.append(_full(info, model, opt))
        return history

    out["halved"] = drive(between=lambda opt, s: _halve_lr(_holder(info, opt), s))
    schedulers = []
    out["StepLR"] = drive(setup=lambda opt: schedulers.append(torch.optim.lr_scheduler.StepLR(
        _holder(info, opt), step_size=1, gamma=0.5)), between=lambda opt, s: schedulers[-1].step())
    out["unfrozen"] = drive(unfreeze=True)

    def loaded(model):
        saved = copy.deepcopy(info.build(Toy(torch.float64), list(Toy(torch.float64).parameters()),
                                         ctx).state_dict())
        opt = info.build(model, list(model.parameters()), ctx)
        opt.load_state_dict(saved)
        return opt
    out["loaded at step 0"] = drive(opt_of=loaded)
    out["straight"] = drive(opt_of=lambda model: info.build(model, model.parameters(), ctx))  # a generator
    if name == "ZeRO1":  # it wraps any elementwise torch optimizer, and refuses the others
        for label, make in ZERO1_WRAPPED.items():
            out[label] = drive(opt_of=lambda model, make=make: _lab("lab2.zero1").ZeRO1(
                list(model.parameters()), make, group=None, lr=LR, **ZERO1_OPTIONS.get(label, {})))
        for refused in (torch.optim.Adafactor, torch.optim.LBFGS, torch.optim.Muon):
            model = Toy(torch.float64)
            try:
                _lab("lab2.zero1").ZeRO1(list(model.parameters()), refused, lr=LR)
                out[refused.__name__] = "accepted"
            except (ValueError, TypeError) as exc:
                out[refused.__name__] = f"{type(exc).__name__}: {exc}"
    return out


ZERO1_WRAPPED = {"AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD, "RMSprop": torch.optim.RMSprop}
ZERO1_OPTIONS = {"AdamW": dict(weight_decay=0.1, amsgrad=True),
                 "SGD": dict(momentum=0.9, nesterov=True, weight_decay=0.01),
                 "RMSprop": dict(centered=True, momentum=0.5)}


@functools.lru_cache(maxsize=None)
def dp_edge_results(name):
    from labkit.ranks import launch

    return launch(_dp_edges, 2, name, timeout=120)


def _adam_reference(G, world, *, halve=False, unfreeze=False, make=None):
    """torch.optim.Adam over every parameter of the toy (the frozen one included, as torch's
    optimizers hold it) with the gradients averaged over ``world`` ranks; ``halve``: the lr
    halved after each step; ``unfreeze``: the frozen parameter trainable after step 1 (its
    gradient: 0.5 everywhere on every rank, from the loss's frozen·0.5 term)."""
    model = Toy(torch.float64)
    named = dict(model.named_parameters())
    opt = make(list(named.values())) if make else torch.optim.Adam(list(named.values()), lr=LR)
    history = []
    for s, step in enumerate(G):
        for n, p in named.items():
            used = [bw[n] for r in range(world) for bw in step[r] if n in bw]
            p.grad = (sum(used) / world) if used and p.requires_grad else None
        if named["frozen"].requires_grad:
            named["frozen"].grad = torch.full_like(named["frozen"], 0.5)
        opt.step()
        if halve:
            _halve_lr(opt, s)
        if unfreeze and s == 0:
            named["frozen"].requires_grad_(True)
        history.append({n: p.detach().clone() for n, p in named.items()})
    return history


@pytest.mark.parametrize("info", DISTRIBUTED, ids=ids)
def test_distributed_optimizers_edge_cases(info):
    """ZeRO-1/2/3 on 2 ranks: the lr changed between steps (by hand and by StepLR, on the
    torch optimizer the wrapper runs: ``.optim``), a parameter unfrozen after step 1 (trained
    from then on as torch's Adam trains it, or refused naming requires_grad), a state_dict
    from before any step: against torch.optim.Adam on the averaged gradients."""
    G = gradients(plan_of(3, 2), torch.float64)
    plain, halved = _adam_reference(G, 2), _adam_reference(G, 2, halve=True)
    for rank, out in enumerate(dp_edge_results(info.name)):
        what = f"{info.name}, rank {rank} of 2"
        for label in ("halved", "StepLR"):
            assert not isinstance(out[label], str), f"{what}, lr {label}: raised {out[label]}"
            assert_histories_close(out[label], halved, f"{what}, lr {label} after each step", **ADAM64)
        assert_histories_close(out["straight"], plain, f"{what}, plain", **ADAM64)
        assert not isinstance(out["loaded at step 0"], str), f"{what}: {out['loaded at step 0']}"
        assert_histories_close(out["loaded at step 0"], out["straight"],
                               f"{what}, a state_dict from before any step", rtol=0, atol=0)
        for label, cls in (ZERO1_WRAPPED.items() if info.name == "ZeRO1" else ()):
            want = _adam_reference(G, 2, make=lambda ps, cls=cls, label=label: cls(
                ps, lr=LR, **ZERO1_OPTIONS[label]))
            assert not isinstance(out[label], str), f"{what} wrapping {label}: raised {out[label]}"
            assert_histories_close(out[label], want, f"{what} wrapping torch.optim.{label}"
                                   f"({ZERO1_OPTIONS[label]})", **ADAM64)
        for refused in (("Adafactor", "LBFGS", "Muon") if info.name == "ZeRO1" else ()):
            assert refused in out[refused] and out[refused] != "accepted", (
                f"{what}: ZeRO1 must refuse torch.optim.{refused} by name (its update is not "
                f"elementwise: a piece of a tensor would be updated as if it were the tensor); "
                f"got {out[refused]}")
        got = out["unfrozen"]
        if isinstance(got, str):
            assert "requires_grad" in got, (f"{what}: a parameter unfrozen after step 1 must be "
                                            f"trained or refused naming requires_grad, got {got}")
        else:
            assert_histories_close(got, _adam_reference(G, 2, unfreeze=True),
                                   f"{what}, the frozen parameter unfrozen after step 1", **ADAM64)


EDGE_OPTIONS = {  # the reference's class -> options at the edges of what it accepts
    torch.optim.Adam: [dict(betas=(0.0, 0.0)), dict(betas=(0.0, 0.999)), dict(eps=0.0), dict(lr=0.0),
                       dict(weight_decay=0.1)],
    torch.optim.Adafactor: [dict(lr=0.0), dict(beta2_decay=0.0), dict(d=4.0), dict(eps=(1e-3, 0.0)),
                            dict(weight_decay=0.1)],
    torch.optim.SGD: [dict(lr=0.0)],
    None: [dict(lr=0.0)],  # no reference (CAME): lr = 0 leaves every parameter where it was
}


@pytest.mark.parametrize("info", [i for i in LOCAL if i.group_options is not None], ids=ids)
def test_hyperparameters_at_their_edges(info, tmp_path):
    """Options at the edges of what torch's optimizer accepts (β = 0, ε = 0, lr = 0, Adafactor's
    β̂₂ decay 0 and wide clipping, weight decay), given as a param group: as the reference
    trains with them — or refused with an error naming the option (one this optimizer does not
    have: never silently ignored)."""
    dtype = _own_dtype(info)
    if info.dtypes[dtype] == "refused":
        dtype = torch.bfloat16
    shapes = [(3, 4), (5,)]
    G = _random_grads(shapes, dtype)
    ref_class = None if info.reference is None else type(info.reference([torch.zeros(1, requires_grad=True)]))
    for options in EDGE_OPTIONS[ref_class]:
        params = _fresh_params(shapes, dtype)
        name = next(iter(options))
        try:
            info.build(_Params(_copies(params)), [{"params": _copies(params), **options}],
                       _ctx(tmp_path, f"probe {options}"))
        except (ValueError, TypeError) as exc:
            assert name in str(exc), f"{info.name} refused {options} without naming {name!r}: {exc}"
            continue
        got, _ = _against_reference(info, params, G, f"options {options}", tmp_path,
                                    spec=lambda ps, options=options: [{"params": ps, **options}],
                                    where=f"edge {options}")
        if options.get("lr") == 0.0:
            for k, p in enumerate(got[-1]):
                assert torch.equal(p, _start[id(params[k])]), f"{info.name} moved parameter {k} with lr = 0"
