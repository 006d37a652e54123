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

import torch

from labkit.optim_base import UpdateInBackward

# ==== given: the course's code — read it, call it, don't change it ====


class LOMO(UpdateInBackward):
    """Plain SGD fused into backward: each parameter is updated, and its gradient freed, in a hook.

    After ``LOMO(model.parameters(), lr)``, every ``loss.backward()`` is also the update: no
    ``step()`` (``zero_grad()`` has nothing to do), and every ``.grad`` is None when backward
    returns. Frozen parameters (``requires_grad=False``) are accepted and left alone, as
    ``torch.optim.SGD`` leaves them; a parameter that gets no gradient in a backward is not
    updated.

    Given (``labkit.optim_base.UpdateInBackward``): ``self.params`` (the parameters that require
    grad, each once), ``self.lr_of(param)`` (its group's learning rate), ``self.handles`` (what
    ``remove()`` removes), ``zero_grad()``; the constructor calls ``_attach()``.

    Not a ``torch.optim.Optimizer``: no ``param_groups``, so no lr scheduler (each group's lr is
    fixed at construction), and no ``add_param_group``. The parameters it trains are those that
    require grad when it is built (the hooks are attached then): one unfrozen later is not
    trained; build a new LOMO.

    Args:
        params: the parameters to train, or parameter groups (dicts with "params" and
            optionally "lr"), as for ``torch.optim.SGD``; a tied parameter listed twice is one.
        lr: the learning rate (> 0 makes it SGD; 0 only frees the gradients); a group's own
            "lr" overrides it for that group's parameters.
    """

    # ==== exercise 2.4: your code ====

    def _attach(self) -> None:
        """Make ``self._update`` run on each of ``self.params`` once its gradient is complete (for
        a parameter used twice, such as a tied embedding, once, after both contributions); keep
        in ``self.handles`` what ``remove()`` needs."""
        raise NotImplementedError("exercise 2.4: make self._update run on each parameter once its gradient is complete; keep in self.handles what remove() needs (labs/02_optimizer_states.ipynb)")

    def _update(self, param: torch.Tensor) -> None:
        """Called with a parameter whose gradient is complete: apply SGD's update to it (autograd
        must not record it) and release its gradient, so that no ``.grad`` outlives its use."""
        raise NotImplementedError("exercise 2.4: update the parameter in place with its group's lr (self.lr_of) without autograd recording it, then set its .grad to None (labs/02_optimizer_states.ipynb)")
