"""What a graded test gives student code stays the test's: checked after the call (not collected).

The rule. A test that computes its reference, or checks a measurement, AFTER calling student
code, from objects that code received (the tensors it was given, the ``grad_out`` handed to a
backward, the forward's outputs passed on to a backward, the leaves the test differentiates
again, a module whose parameters the reference reuses), must know those objects are as it made
them: otherwise the exercise chooses what it is compared with (zero ``q`` and ``v`` and attention
is trivially right; zero ``grad_out`` and every gradient is 0 = 0; a gradient hook left on the
test's leaf turns the reference's gradients into zeros too). So every such call runs inside
``given(...)`` (or through ``as_given(fn)``), which afterwards asserts, for each object named:

* its value is unchanged: dtype, shape, ``requires_grad`` and every element, compared exactly
  with a copy taken before the call, NaN equal to NaN (written through ``.data``, ``.detach()``,
  ``set_`` or an in-place operator alike: the copy sees the values, not the route);
* torch's global hooks and modes are as they were (``torch_globals``: saved-tensor hooks left
  installed would pack the test's reference too);
* no hook was added to it: a tensor's ``_backward_hooks`` and ``_post_accumulate_grad_hooks``; a
  module's (and each submodule's) forward/backward hook dicts, and the hooks of its parameters;
* an argument holding no tensor (a list of byte counts, a list of TensorLife) is compared with
  a deep copy by ``==``.

The failure names the call and the argument: "flash_attention_backward changed grad_out in
place: it must leave its inputs as given".

Copies, not checksums. A checksum (sums, sums of squares) is blind to permutations and to
writes that keep it; an exact copy is not. The price is memory, so the copies are taken where
no measurement looks: ``given(...)`` is entered BEFORE a measured region (MemTracker,
``peak_bytes``, FlopCounterMode, a counting dispatch mode) and checks after it is left; the
tensors it copies existed before the region, so a measurement that counts what is created
inside it is unchanged. ``as_given(fn)``, which copies at call time, is used only for calls
that are not measured; where it must run inside a region anyway, its copies and comparisons run
with the dispatch modes disabled (``_disable_current_modes``) and grad off, so no counting mode
or MemTracker's tracking mode sees them.

Where it is used: 2.2 (quantize/dequantize), 3.1 (scale: the loss and its leaf), 3.3 (fp8 quantize, Fp8Linear forward and backward:
the layer, x and grad_out), 5.1/5.3 (schedule_cost, optimal_schedule: the cost lists), 5.5 (the
leaves whose saved tensors the offloader packs), 5.6 (forward and backward, grad_out and the
forward's O and L passed to it), 5.7 (attention_with_lse, merge_attention), 5.8 (slice_dropout),
5.9 (hidden, weight, targets), 6.2 (the planners' TensorLife lists), 6.5 (x and grad_out),
6.6 (assign_slots, dispatch and combine, and their backward's grad_out).

Not checked this way, and why:
* the contract writes its inputs: optimizer steps (2.1 Adafactor, 2.3 Adam8bit, 2.5 ZeRO-1,
  2.6 ZeRO-Offload, 2.7 NVMe offload, 2.8 CAME, 3.2 mixed precision: ``step()`` updates the
  parameters and the state in place and reads ``.grad``); any backward's ``.grad`` on the
  test's leaves (the result, not an input); 2.4 LOMO (fuses the update into backward through
  hooks on the parameters: hooks are its contract); 3.1's unscale_/step/update (unscale
  ``.grad`` in place and step); 4.1 gradient accumulation (steps the model); 4.2 bucketed DDP, 4.3 ZeRO-2, 4.4
  compression hooks, 4.5 PowerSGD (install gradient hooks, write buckets and ``.grad``);
  5.2/5.4 (apply_schedule and selective checkpointing rewrite the model they are given: the
  references are fresh models built from the same seed);
* the exercise runs on other ranks (3.4, 3.6-3.8, 4.2-4.5, 5.7's and 5.8's rings, 6.4's and
  6.6's layers, 7.2): ``labkit.ranks.launch`` gives every rank its own copy of the arguments,
  so nothing a rank writes reaches the test's objects;
* the reference is computed before the call, or from values nobody can change in place (ints,
  tuples, frozen dataclasses): lab 1's calculators, 3.5's schedules, 5.4's policy, 6.1's
  allocator (the exercise object itself), 6.3's mesh, 6.4's formulas, 7.1's planner.

``ctx_bytes(out, skip)``: what a custom autograd Function keeps OUTSIDE ``save_for_backward``
(tensors set as ctx attributes, also inside lists, tuples, dicts and plain objects), which
saved-tensor hooks never see: the saved-bytes tests add it to what the hooks counted (3.3,
5.6, 5.9, 6.5).

``assert_state_kept_in_state(opt)``: every tensor reachable from the optimizer object
(``vars(opt)`` through containers and plain objects; its parameters and their gradients aside)
is in what ``state_bytes`` counts: moments kept in another attribute are state too (2.1, 2.3,
2.8, 3.2). 2.7's NVMe Adam, whose state lives in files, must hold no tensor at all after a step
(``held_bytes``). Not used for ZeRO-1 (2.5: its state is checked on ranks) nor ZeRO-Offload
(2.6: its object keeps the host master, moments and gradient buffers by design, which its own
test counts by location).

The same tests write a mismatch as "not within tolerance", ``~(err <= tol)``, never
``err > tol``: NaN compares False, so a one-sided mask counts a NaN as a match.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import types
import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes

TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")
MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
                "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks")


@contextlib.contextmanager
def _quiet():
    """No dispatch mode and no autograd: copies and comparisons nothing measures."""
    with _disable_current_modes(), torch.no_grad():
        yield


def torch_globals() -> dict:
    """torch's global hooks and modes now: the saved-tensor default hooks, the dispatch and
    function mode stacks, the hooks every module's forward and every optimizer's step run. A
    contract that installs one takes it off again before it returns (or at its ``with``'s end)."""
    import torch.nn.modules.module as module
    import torch.optim.optimizer as optimizer

    hooks = {n: v for n, v in vars(module).items() if n.startswith("_global_") and n.endswith("hooks")}
    hooks |= {n: getattr(optimizer, n) for n in ("_global_optimizer_pre_hooks",
                                                 "_global_optimizer_post_hooks")}
    return {"saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(True),
            "dispatch modes": torch._C._len_torch_dispatch_stack(),
            "torch-function modes": torch._C._len_torch_function_stack(),
            **{n: tuple(map(id, v.values())) for n, v in hooks.items()}}


def _hook_ids(obj, names) -> tuple:
    out = []
    for name in names:
        hooks = getattr(obj, name, None) or {}
        out.append(tuple((k, id(v)) for k, v in dict(hooks).items()))
    return tuple(out)


def _flatten(name, obj, into):
    """(name, object) pairs of the tensors and modules inside ``obj`` (containers walked)."""
    if isinstance(obj, (torch.Tensor, torch.nn.Module)):
        into.append((name, obj))
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            _flatten(f"{name}[{i}]", x, into)
    elif isinstance(obj, dict):
        for k, x in obj.items():
            _flatten(f"{name}[{k!r}]", x, into)
    return into


def _snapshot(t: torch.Tensor):
    return (t.dtype, tuple(t.shape), t.requires_grad, t.detach().clone(), _hook_ids(t, TENSOR_HOOKS))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exactly equal, NaN equal to NaN at the same places (dtype and shape too)."""
    with _quiet():
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.device.type == "meta" or b.device.type == "meta":  # no values to compare
            return a.device == b.device
        if a.is_floating_point() or a.is_complex():
            na, nb = a.isnan(), b.isnan()
            if not torch.equal(na, nb):
                return False
            a, b = a.masked_fill(na, 0), b.masked_fill(nb, 0)
        return torch.equal(a, b)


def _plain_copy(obj):
    """A deep copy of an object holding no tensor (a list of byte counts, a config dataclass)
    that compares equal to it now; None where there is none (no ``==`` by value)."""
    import copy

    try:
        kept = copy.deepcopy(obj)
        return (kept,) if bool(kept == obj) else None
    except Exception:  # noqa: BLE001  (not copyable or not comparable: not checked)
        return None


class given:
    """``with given("what", name=obj, ...):`` snapshots each named tensor or module (tensors in
    lists/tuples/dicts too; an object with no tensor in it, such as a list of numbers or a
    config, as a deep copy compared with ``==``) on entry, and on exit asserts values unchanged
    and no hook added."""

    def __init__(self, what: str, /, **objects):
        self.what = what
        self.objects, self.plain = [], []
        for name, obj in objects.items():
            found = _flatten(name, obj, [])
            if found:
                self.objects.extend(found)
            elif not isinstance(obj, (int, float, complex, str, bytes, bool, type(None))):
                self.plain.append((name, obj))

    def __enter__(self):
        self.kept, self.globals = [], torch_globals()
        self.plain_kept = [(name, obj, _plain_copy(obj)) for name, obj in self.plain]
        with _quiet():
            for name, obj in self.objects:
                if isinstance(obj, torch.nn.Module):
                    tensors = [(f"{name}.{n}", t) for n, t in
                               [*obj.named_parameters(), *obj.named_buffers()]]
                    mods = [(f"{name}.{n}" if n else name, m, _hook_ids(m, MODULE_HOOKS))
                            for n, m in obj.named_modules()]
                    self.kept.append((None, None, mods))
                else:
                    tensors = [(name, obj)]
                self.kept.extend((n, t, _snapshot(t)) for n, t in tensors)
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None:
            return False
        self.check()
        return False

    def check(self):
        now = torch_globals()
        changed = [k for k in now if now[k] != self.globals[k]]
        assert not changed, (
            f"{self.what} left torch's {', '.join(changed)} changed: hooks and modes a contract "
            "installs come off before it returns, or they act on the test's own reference")
        for name, obj, kept in self.plain_kept:
            if kept is not None:
                assert bool(obj == kept[0]), (
                    f"{self.what} changed {name} in place: it must leave its inputs as given")
        for name, t, kept in self.kept:
            if name is None:  # a module's hook dicts
                for mname, m, hooks in kept:
                    assert _hook_ids(m, MODULE_HOOKS) == hooks, (
                        f"{self.what} added a hook to the test's module {mname}: it must leave "
                        "its inputs as given, with no hooks")
                continue
            dtype, shape, grad, values, hooks = kept
            assert _hook_ids(t, TENSOR_HOOKS) == hooks, (
                f"{self.what} left a hook on {name} (register_hook or "
                "register_post_accumulate_grad_hook on the test's tensor): it must leave its "
                "inputs as given, with no hooks")
            assert (t.dtype, tuple(t.shape), t.requires_grad) == (dtype, shape, grad), (
                f"{self.what} changed {name} from {dtype} {shape} (requires_grad={grad}) to "
                f"{t.dtype} {tuple(t.shape)} (requires_grad={t.requires_grad}): it must leave its "
                "inputs as given")
            assert same_values(t.detach(), values), (
                f"{self.what} changed {name} in place: it must leave its inputs as given")


def as_given(fn, what: str | None = None):
    """``fn`` checked, call by call, to leave every tensor (and module) argument as given
    (names from its signature). For calls that are not measured: the copies are taken at call
    time (with the dispatch modes off)."""
    what = what or getattr(fn, "__name__", "the exercise")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            named = dict(signature.bind(*args, **kwargs).arguments)
        except (AttributeError, TypeError):
            named = {f"argument {i}": a for i, a in enumerate(args)} | kwargs
        with given(what, **named):
            return fn(*args, **kwargs)
    return run


def _storage_bytes(roots, skip=(), into_torch=True) -> int:
    """Bytes of the distinct storages of the tensors (and storages) reachable from ``roots``
    through every reference the garbage collector sees (containers of any type, objects'
    attributes and slots, a tensor's own attributes, iterators, generators' frames, bound methods,
    partials, a weakref.finalize's arguments), functions through their closures and default
    values only; not into modules, classes, nn.Modules or code, nor into torch's own objects
    unless ``into_torch``. Storages of ``skip`` are not counted."""
    with _quiet():
        skipped = {t.untyped_storage().data_ptr() for t in skip if isinstance(t, torch.Tensor)}
        seen, storages, todo = {}, {}, list(roots)  # (seen keeps each alive: no id reused)
        while todo:
            x = todo.pop()
            if id(x) in seen:
                continue
            seen[id(x)] = x
            if isinstance(x, (torch.Tensor, torch.UntypedStorage)):
                st = x.untyped_storage() if isinstance(x, torch.Tensor) else x
                if st.data_ptr() not in skipped:
                    storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
                todo += [getattr(x, "__dict__", {})]  # (a tensor's own attributes)
            elif isinstance(x, types.FunctionType):  # a closure's cells and default values
                todo += [c.cell_contents for c in x.__closure__ or () if c.cell_contents is not c] \
                    + [x.__defaults__, x.__kwdefaults__]
            elif isinstance(x, weakref.finalize):  # (its arguments: in weakref's own registry)
                todo += [x.peek()]
            elif not isinstance(x, (type, types.ModuleType, types.CodeType, torch.nn.Module)) \
                    and (into_torch or isinstance(x, dict) or not type(x).__module__.startswith("torch")):
                todo += gc.get_referents(x)  # (a callable object's attributes too)
    return sum(storages.values())


def ctx_bytes(out, skip=()) -> int:
    """Bytes of the distinct storages a custom autograd Function in ``out``'s graph keeps as ctx
    ATTRIBUTES (not through save_for_backward): tensors in ``vars(node)``, also inside lists,
    tuples, sets, dicts and plain objects; and the parameters (or views of them) it saves, which
    ``labkit.measure.saved_activation_bytes`` skips as the model's: a Function's own are not.
    Storages of ``skip`` (the inputs, which live anyway) are not counted."""
    outs = out if isinstance(out, (list, tuple)) else [out]
    nodes = [o.grad_fn for o in outs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    seen, roots = set(), []
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        roots.append(getattr(node, "__dict__", {}))
        with contextlib.suppress(RuntimeError):  # (a custom Function's; freed after backward)
            roots += [t for t in getattr(node, "saved_tensors", ())
                      if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)]
        nodes.extend(n for n, _ in node.next_functions)
    return _storage_bytes(roots, skip, into_torch=False)


def held_bytes(obj, skip=()) -> int:
    """Bytes of the distinct storages of every tensor reachable from ``obj``'s attributes
    (``vars(obj)``, through lists, tuples, sets, dict keys and values, objects, closures; not
    into modules, classes or nn.Modules). For an optimizer: what it keeps between steps wherever
    it keeps it, ``state`` or any other attribute. Storages of ``skip`` (its parameters and
    their gradients, which live anyway) are not counted."""
    return _storage_bytes([vars(obj)], skip)


def optimizer_held_bytes(opt, skip=()) -> int:
    """``held_bytes`` of an optimizer, its parameters and their ``.grad`` skipped (and ``skip``:
    tables the given code keeps, such as Adam8bit's two 256-entry codes)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return held_bytes(opt, skip=[*params, *(p.grad for p in params), *skip])


def assert_state_kept_in_state(opt, skip=()) -> None:
    """What the optimizer object holds (``optimizer_held_bytes``) is what ``state_bytes`` counts:
    no moments kept in another attribute, where a count of ``opt.state`` would not see them."""
    from labkit.optimizer_states import state_bytes

    held, counted = optimizer_held_bytes(opt, skip), state_bytes(opt)
    assert held == counted, (
        f"{type(opt).__name__} holds {held:,} bytes of tensors (its parameters and gradients "
        f"aside), its state {counted:,}: keep what it keeps between steps in opt.state, where "
        "it is counted, not in another attribute")
