"""LOMO: fuse the SGD update into backward, so no optimizer state and almost no gradients live.

An ordinary step holds every gradient at once: backward writes all Ψ of them into ``.grad``,
then ``optimizer.step()`` reads them, then they are freed, so the step peaks with Ψ gradients
alive (4Ψ bytes in fp32). LOMO (LOw-Memory Optimization, Lv et al. 2023, arXiv 2306.09782)
updates each parameter the moment its gradient is complete, inside backward, and drops that
gradient at once: θ ← θ − lr·g, then ``g`` is freed. Plain SGD keeps no state, and at any moment
at most about one parameter's gradient is alive: the peak of gradient bytes falls from the sum
of all gradients to the largest single one.

Mechanism: autograd can call a function on a leaf tensor right after it has accumulated that
parameter's complete gradient into ``param.grad`` (for a parameter used twice, such as a tied
embedding, after both contributions); finding that hook is part of exercise 2.4. The result is SGD
with the same parameters as ``torch.optim.SGD(lr=lr)`` after an ordinary backward. What it
cannot do in one backward is anything that needs every gradient first, such as clipping by the
global gradient norm (the paper computes the norm in a first backward, updates in a second).

Chapter 2 (book/02_optimizer_states.md); Lab 2, exercise 2.4 (labs/02_optimizer_states.ipynb).
"""
from __future__ import annotations

import warnings

import torch


class LOMO:
    """Plain SGD fused into backward: each parameter is updated, and its gradient freed, in a hook.

    After ``LOMO(model.parameters(), lr)``, every ``loss.backward()`` is also the update: no
    ``step()``, no ``zero_grad()``, and every ``.grad`` is None when backward returns.

    Args:
        params: the parameters to train (each must require grad).
        lr: the learning rate (> 0 makes it SGD; 0 only frees the gradients).
    """

    def __init__(self, params, lr: float):
        if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr >= 0):
            raise ValueError(f"lr must be a number >= 0, got {lr!r}")
        self.lr = float(lr)
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors, got a single tensor")
        unique: dict[int, torch.Tensor] = {}
        for p in params:  # a tied parameter listed twice is one parameter: one hook, one update
            if not (isinstance(p, torch.Tensor) and p.requires_grad):
                raise ValueError("params must be a non-empty iterable of tensors that require grad, "
                                 f"got {type(p).__name__}" + ("" if not isinstance(p, torch.Tensor)
                                                             else " with requires_grad=False"))
            unique.setdefault(id(p), p)
        self.params = list(unique.values())
        if not self.params:
            raise ValueError("params must be a non-empty iterable of tensors that require grad")
        self.handles = []
        # BEGIN SOLUTION 2.4: make self._update run on each parameter once its gradient is complete; keep in self.handles what remove() needs
        for p in self.params:
            self.handles.append(p.register_post_accumulate_grad_hook(self._update))
        # END SOLUTION

    def _update(self, param: torch.Tensor) -> None:
        """Called with a parameter whose gradient is complete: apply SGD's update to it (autograd
        must not record it) and release its gradient, so that no ``.grad`` outlives its use."""
        # BEGIN SOLUTION 2.4: update the parameter in place without autograd recording it, then set its .grad to None
        with torch.no_grad():
            param.add_(param.grad, alpha=-self.lr)
        param.grad = None
        # END SOLUTION

    def remove(self) -> None:
        """Remove the hooks: backward goes back to only computing gradients."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


def lomo_step(model: torch.nn.Module, optimizer, batch) -> torch.Tensor:
    """A training step for ``labkit.measure.measure_step`` when LOMO is attached: forward and
    backward only (backward is the update). ``optimizer`` is ignored (pass None).

    MemTracker's own post-accumulate-grad hook runs after LOMO's and finds ``.grad`` already
    freed; its warning about that None is silenced here.
    """
    x, y = batch
    loss = model(x, y)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper")
        loss.backward()
    return loss.detach()
