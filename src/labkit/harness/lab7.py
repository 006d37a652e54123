"""Harnesses for lab 7's exercise 7.2: a student's plan run on real gloo ranks and measured.

``run_plans_worker`` builds each plan with the student's ``labkit.lab7.run_plan`` (``check_plan``,
``build_rank``, ``train_step``) and measures every rank's peak with PyTorch's ``MemTracker``
(without its leak of a pipeline stage's received activations: ``releasing_module_hooks``);
``build_worker`` builds a plan only and reports each rank's place in the mesh and its groups. A
stub of an earlier exercise is named (``_prerequisite_error``) instead of a traceback.
"""
from __future__ import annotations

import contextlib
import time

import torch.distributed as dist

from labkit.lab7.run_plan import PREREQUISITES, build_rank, check_plan, train_step
from labkit.measure import peak_over_calls
from labkit.models import GPT, GPTConfig


def _prerequisite_error(exc: NotImplementedError) -> Exception:
    """A stub of an earlier exercise was hit: name it, rather than a traceback from deep inside."""
    text = str(exc)
    if text.startswith("exercise 7.2"):
        return exc  # 7.2 itself: the grader reports "not attempted"
    exercise = text.split(":")[0].removeprefix("exercise ").strip() if text.startswith("exercise ") else "?"
    module = next((m for m, e in PREREQUISITES.items() if e == exercise), "an earlier exercise's module")
    return RuntimeError(
        f"exercise 7.2 runs the plan on your own pieces, but exercise {exercise} ({module}) is "
        f"not done yet: {text}. Make labkit.check(\"{exercise}\") pass first; exercise 7.2 needs "
        f"exercises {', '.join(sorted(set(PREREQUISITES.values())))}.")


GRAD_PROBES = ("wte.weight", "lm_head.weight", "ln_f.weight")
"""Parameters whose gradient norm the harness records when the first step begins: never split by
tensor parallelism, and the tied weight's two pipeline copies among them."""


def _record_grad_norms(setup) -> dict:
    """Wrap ``setup.optimizer.step`` so that, on its first call, the norms of the GRAD_PROBES
    this rank holds are recorded (floats: no tensor kept, MemTracker's peak unchanged) before
    the real step runs. Adam hides a gradient's scale (m/√v); these norms do not."""
    norms: dict = {}
    params = dict(setup.module.named_parameters())
    real_step = setup.optimizer.step

    def step(*args, **kwargs):
        if not norms:
            for name in GRAD_PROBES:
                p = params.get(name)
                if p is not None and p.grad is not None:
                    norms[name] = float(p.grad.norm())
            norms.setdefault("recorded", 1.0)
        return real_step(*args, **kwargs)

    setup.optimizer.step = step
    return norms


@contextlib.contextmanager
def releasing_module_hooks():
    """While MemTracker runs, let its module tracker's backward hooks release the autograd graph
    once they have fired; without this, MemTracker keeps alive every leaf input of a module call
    that requires grad — on a pipeline stage after the first, each received activation and its
    gradient — for as long as the process lives (it does not change what it counts, only what
    stays alive to be counted).

    Why: ``ModTracker`` (torch/distributed/_tools/mod_tracker.py, torch 2.13) registers, before
    each module call, ``torch.autograd.graph.register_multi_grad_hook`` on the call's inputs
    that require grad. In its "all" mode that hook's closure keeps the list of the inputs'
    autograd nodes (``grad_fns``); a leaf's node (AccumulateGrad) holds the leaf, and the leaf
    holds the hook: a cycle through C++ objects that Python's garbage collector cannot see. In a
    pipeline measured over 3 steps, a stage after the first then held the received inputs and
    their gradients of every micro-batch of the earlier steps (on PP 4, 1F1B, M = 4: 8 of 128 KiB
    each a step; stage 2's peak 27% above what the run holds); without MemTracker nothing is
    left (0 such tensors after each step). Here the hook's list is emptied once the hook has
    fired (it is read only at its first call of a backward), which breaks the cycle; what the
    hook does is unchanged. Restored on exit.
    """
    from torch.distributed._tools import mod_tracker

    register = mod_tracker.register_multi_grad_hook

    def register_releasing(tensors, fn, *, mode="all"):
        if mode != "all":
            return register(tensors, fn, mode=mode)
        held = []  # the lists of autograd nodes in the hooks' closures

        def fire(grads):
            fn(grads)
            for nodes in held:
                nodes.clear()

        handle = register(tensors, fire, mode=mode)
        for one in getattr(handle, "handles", ()):
            hooks = one.hooks_dict_ref()
            hook = None if hooks is None else hooks.get(one.id)
            code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None) or ()
            for name, cell in zip(getattr(code, "co_freevars", ()), cells):
                if name == "grad_fns" and isinstance(cell.cell_contents, list):
                    held.append(cell.cell_contents)
        return handle

    mod_tracker.register_multi_grad_hook = register_releasing
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register


def run_plans_worker(rank: int, world_size: int, plans, cfg: GPTConfig, state: dict,
                     batches) -> list[dict]:
    """Run by ``labkit.ranks.launch``: for each plan, build the GPT from ``state``, check the plan,
    :func:`build_rank`, then :func:`train_step` on each ``batches[step] = (x, y)`` under MemTracker
    (with :func:`releasing_module_hooks`).

    Returns, per plan, ``{"label", "coords", "losses": per step (None where this rank computes
    no loss), "peak": MemTracker's peak bytes over the steps, "at_peak": bytes by consumer at
    that moment, "seconds", "grads_left": the names of the module's parameters whose ``.grad`` is
    still set after the last step, "grad_norms": the norms of ``GRAD_PROBES``' gradients as the
    first optimizer step begins}``. A stub of an earlier exercise → RuntimeError naming it."""
    out = []
    for plan in plans:
        try:
            check_plan(plan, cfg, batches[0][0].shape[0], world_size)
            model = GPT(cfg)
            model.load_state_dict(state)
            setup = build_rank(plan, model, rank)
            del model
            grad_norms = _record_grad_norms(setup)
            started = time.perf_counter()
            with releasing_module_hooks():
                peak, at_peak, losses = peak_over_calls(
                    setup.module, lambda: [train_step(setup, x, y) for x, y in batches])
            seconds = time.perf_counter() - started
        except NotImplementedError as exc:
            raise _prerequisite_error(exc) from None
        grads_left = [n for n, p in setup.module.named_parameters() if p.grad is not None]
        dist.barrier()
        out.append({"label": plan.label, "coords": setup.coords, "losses": losses, "peak": peak,
                    "at_peak": at_peak, "seconds": seconds, "grads_left": grads_left,
                    "grad_norms": grad_norms})
    return out


def build_worker(rank: int, world_size: int, plan, cfg: GPTConfig, state: dict) -> dict:
    """Run by ``labkit.ranks.launch``: ``build_rank`` only. Returns this rank's ``coords`` and the
    ranks of each of its groups (``"embedding"``: None when the rank has none)."""
    try:
        check_plan(plan, cfg, 2 * plan.dp * plan.n_micro, world_size)
        model = GPT(cfg)
        model.load_state_dict(state)
        setup = build_rank(plan, model, rank)
    except NotImplementedError as exc:
        raise _prerequisite_error(exc) from None
    groups = {axis: (None if g is None else dist.get_process_group_ranks(g))
              for axis, g in setup.groups.items()}
    return {"coords": dict(setup.coords), "groups": groups}
