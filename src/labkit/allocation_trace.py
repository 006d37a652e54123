"""Allocation traces of a real training step: record one, check one, read its peak.

A trace is the list of ``("alloc", id, nbytes)`` and ``("free", id, 0)`` events of the storages a
computation creates and frees, in order: what a memory allocator sees. Lab 6 replays one in its
caching-allocator simulator (exercise 6.1, ``labkit.harness.lab6.replay``) and plans one
statically (exercise 6.2); chapter 6 does both at several batch sizes.

* ``record_trace(fn, ...)``: run ``fn`` under a ``TorchDispatchMode`` and write down every
  storage an operator creates (``weakref.finalize`` records its free);
* ``gpt_training_step()``: one training step of the lab's GPT, to record;
* ``check_trace(trace)``: refuse a malformed trace, naming the event;
* ``peak_live_bytes(trace)``: the most bytes alive at once, the lower bound of any allocator;
* ``retained_bytes(fn, x)``: what ``fn(x)`` leaves alive while its output lives (lab 6's fusion).

Course toolkit: it imports no lab package. Chapter 6 (book/06_system.md); lab 6.
"""
from __future__ import annotations

from labkit.validate import non_negative_int, positive_int, tensor

__all__ = ["check_trace", "gpt_training_step", "peak_live_bytes", "record_trace", "retained_bytes"]


def check_trace(trace) -> list:
    """A trace is a list of ``("alloc", id, nbytes)`` and ``("free", id, 0)``; each id (hashable)
    is allocated once and freed at most once, after its allocation. Returns it as a list."""
    if isinstance(trace, (str, bytes)) or not hasattr(trace, "__iter__"):
        raise TypeError(f"trace must be a list of ('alloc'|'free', id, nbytes) tuples, got {type(trace).__name__}")
    trace = list(trace)
    live, seen = set(), set()
    for k, event in enumerate(trace):
        if not (isinstance(event, tuple) and len(event) == 3 and event[0] in ("alloc", "free")):
            raise ValueError(f"trace[{k}] must be ('alloc'|'free', id, nbytes), got {event!r}")
        op, ident, nbytes = event
        try:
            hash(ident)
        except TypeError:
            raise TypeError(f"trace[{k}]: the id must be hashable (an int), got {ident!r}") from None
        non_negative_int(f"trace[{k}] nbytes", nbytes)
        if op == "alloc":
            if ident in seen:
                raise ValueError(f"trace[{k}]: id {ident!r} allocated twice")
            seen.add(ident)
            live.add(ident)
        else:
            if ident not in live:
                raise ValueError(f"trace[{k}]: free of id {ident!r}, which is not allocated")
            live.remove(ident)
    return trace


def record_trace(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` and record every storage it creates and frees, in order.

    A ``TorchDispatchMode`` sees every tensor an operator returns (forward, backward and the
    optimizer alike); a storage that is not one of the operator's inputs' (in-place results
    and views are not allocations) and not already recorded is an allocation of its ``nbytes``,
    and a ``weakref.finalize`` on it records the free. Storages that existed before (the
    parameters) are not in the trace; zero-byte storages are skipped (the CUDA allocator does
    not allocate them either). Returns ``(trace, result of fn)``; ids are consecutive ints.
    """
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    events, live = [], {}
    counter = [0]

    def on_free(key, ident):
        if live.get(key) == ident:
            del live[key]
        events.append(("free", ident, 0))

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inputs = {(t.untyped_storage().device.type, t.untyped_storage().data_ptr())
                      for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                st = t.untyped_storage()
                key = (st.device.type, st.data_ptr())
                if st.nbytes() == 0 or key in live or key in inputs:  # in-place results and views
                    continue
                ident = counter[0]
                counter[0] += 1
                live[key] = ident
                events.append(("alloc", ident, st.nbytes()))
                weakref.finalize(st, on_free, key, ident)
            return out

    with _Recorder():
        result = fn(*args, **kwargs)
    return list(events), result  # frees after the mode exits are not part of the recording


def gpt_training_step(batch_size: int = 16, seed: int = 0):
    """A zero-argument callable that runs one training step (forward, backward, Adam, grads set
    to None) of the lab's GPT (``lab_config("cpu")``) on batch ``batch_size`` of ``SyntheticData``.

    Its first call also creates Adam's states; later calls allocate and free the same tensors.
    The model, the optimizer and the batch are its attributes ``model``, ``optimizer``, ``batch``.
    ``record_trace(gpt_training_step())[0]`` is the trace of a first step.
    """
    import torch

    from labkit.models import GPT, SyntheticData, lab_config

    batch_size = positive_int("batch_size", batch_size)
    cfg = lab_config("cpu")
    torch.manual_seed(non_negative_int("seed", seed))
    model = GPT(cfg)
    optimizer = torch.optim.Adam(model.parameters())
    x, y = SyntheticData(cfg.vocab_size, cfg.block_size, batch_size).batch(0)

    def step():
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step.model, step.optimizer, step.batch = model, optimizer, (x, y)
    return step


def peak_live_bytes(trace) -> int:
    """The peak of the bytes alive at once: the requests of every tensor alive together, the
    least memory any allocator needs for the trace (a 0-byte request takes none)."""
    trace = check_trace(trace)
    sizes, live, peak = {}, 0, 0
    for op, ident, nbytes in trace:
        if op == "alloc":
            sizes[ident] = nbytes
            live += nbytes
            peak = max(peak, live)
        else:
            live -= sizes.pop(ident)
    return peak


def retained_bytes(fn, x) -> int:
    """Bytes of the tensors created by ``y = fn(x)`` that are still alive after it returns,
    while ``y`` (and so its autograd graph) is alive: the output plus what backward keeps."""
    tensor("x", x)
    trace, y = record_trace(fn, x)
    sizes = {}
    for op, ident, nbytes in trace:
        if op == "alloc":
            sizes[ident] = nbytes
        else:
            sizes.pop(ident)
    del y
    return sum(sizes.values())
