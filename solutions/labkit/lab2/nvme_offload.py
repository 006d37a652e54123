"""NVMe offload (ZeRO-Infinity): the optimizer states live in files, one group in memory at a time.

ZeRO-Offload (``labkit.lab2.zero_offload``) moves Adam's 12Ψ bytes from the GPU to host memory. For
the largest models host memory is too small as well, and ZeRO-Infinity (Rajbhandari et al.
2021, "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep Learning", arXiv
2104.07857) moves them one level further, to NVMe drives. The step then streams the state: for
each group of parameters it reads the group's fp32 master weights, m and v from the drive,
updates them, and writes them back, while the next group is already being read (a bounded
read-ahead, so the drive's latency hides behind the update). Host memory holds only the
read-ahead window, never the whole state.

Here a group is one parameter tensor and its state is one file ``group_XXXX.bin``: [master
(16-bit parameters only), m, v] in fp32, K = 12 bytes an element for 16-bit parameters, 8 for
fp32 ones (the parameter itself is the master; an fp64 parameter keeps fp64 moments, K = 16);
``step.json`` holds the step counts: each parameter's own, as ``torch.optim.Adam`` keeps them (a
parameter without a gradient is skipped and its count does not advance, so its bias corrections
start at its first gradient). The files, their reads and writes and the count of every byte are
given (``labkit.nvme_files.StateFiles``); the directory is the checkpoint: a new ``NVMeAdam`` on
it resumes. Per step the files give K·Ψ bytes and take K·Ψ back; the resident state is at most
the window, K × (the largest read_ahead + 1 consecutive groups).

Chapter 2 (book/02_optimizer_states.md); Lab 2, exercise 2.7 (labs/02_optimizer_states.ipynb).
"""
from __future__ import annotations

import math

import torch

from labkit.nvme_files import StateFiles
from labkit.optim_base import run_closure

# ==== given: the course's code — read it, call it, don't change it ====


class NVMeAdam(StateFiles):
    """Adam (``torch.optim.Adam``'s update) whose state lives in files under ``directory``.

    A new directory is filled with the initial state (master = the parameters, m = v = 0); a
    directory that already holds this layout (same tensor sizes and dtypes) is *resumed*: its
    master weights, moments and step counts continue where they were written.

    Given by ``labkit.nvme_files.StateFiles`` (the exercise uses it):
        groups: the parameters, one tensor per group; ``K[i]``: state bytes per element.
        options[i]: group i's Adam options, ``{"lr", "betas", "eps", "weight_decay"}``.
        steps[i]: the steps group i has taken (its own count, for its bias corrections).
        prefetch(i): start reading group i's state on the I/O thread; returns a ``Prefetch``
            whose ``result()`` waits and hands over ``{"master"?, "exp_avg", "exp_avg_sq"}``
            (tensors of the parameter's shape in ``state_dtype[i]``, fp32 here unless the
            parameter is fp64; "master" only for 16-bit parameters), once.
        write_group(i, state): write that dict back to group i's file.
        write_steps(): record ``step_count`` and ``steps`` in ``step.json``.
        step_count: calls of ``step()`` so far; ``bytes_read``, ``bytes_written``,
            ``resident_bytes``, ``peak_resident_bytes``, ``events``: what the graders count.
        zero_grad(), close().

    Not a ``torch.optim.Optimizer``: no ``param_groups``, so no lr scheduler (each group's
    options are fixed at construction) and no ``add_param_group``; its checkpoint is its
    directory (no ``state_dict``).

    Args:
        params: the parameters, or parameter groups (dicts with "params" and any of lr, betas,
            eps, weight_decay), as for ``torch.optim.Adam``.
        directory: where the state files live (created if missing).
        lr, betas, eps, weight_decay: ``torch.optim.Adam``'s (L2 weight decay, added to the
            gradient).
        read_ahead: how many groups beyond the one being updated may be read at once (≥ 0).
    """

    # ==== exercise 2.7: your code ====

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step of every parameter that has a gradient, streaming the state from files.

        Contract: afterwards each parameter (and, for 16-bit parameters, its fp32 master)
        equals what ``torch.optim.Adam`` keeping its state in memory would give (each group's
        own ``options``; a 16-bit parameter is its fp32 master rounded; the L2 weight decay
        taken from the fp32 master); a parameter without a gradient is skipped and its own step
        count ``steps[i]`` does not advance (its bias corrections use its count, as Adam's do);
        ``step_count`` counts the calls; every group's file and ``step.json`` hold the new state,
        so a new ``NVMeAdam`` on this directory continues identically. Each group's state is
        read once (``prefetch``) and written once (``write_group``), the read of the next groups is issued before the current group is
        updated, and at no moment are more than ``read_ahead`` groups beyond the current one
        read and alive in memory (drop each group's buffers once written). ``closure``
        (optional, given) runs first, as for ``torch.optim``; its loss is returned.
        """
        loss = run_closure(closure)
        self.check_gradients()  # given: refuses a sparse gradient before any file changes
        # BEGIN SOLUTION 2.7: stream the groups with a gradient through a window of read_ahead prefetches; for each: Adam on its state with its options and its own step count (master for 16-bit), write it back, free it; then record the steps
        todo = [i for i, p in enumerate(self.groups) if p.grad is not None]
        pending = {}
        for j in range(min(self.read_ahead + 1, len(todo))):
            pending[todo[j]] = self.prefetch(todo[j])
        for j, i in enumerate(todo):
            state = pending.pop(i).result()
            p, opts = self.groups[i], self.options[i]
            beta1, beta2 = opts["betas"]
            t = self.steps[i] + 1
            bias1, bias2 = 1 - beta1 ** t, 1 - beta2 ** t
            weight = state.get("master", p)
            m, v = state["exp_avg"], state["exp_avg_sq"]  # in the state dtype (fp32 or fp64)
            grad = p.grad.detach().to("cpu", m.dtype)
            if opts["weight_decay"]:
                grad = grad.add(weight.to("cpu", m.dtype), alpha=opts["weight_decay"])
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(bias2)).add_(opts["eps"])
            if "master" in state:
                weight.addcdiv_(m, denom, value=-opts["lr"] / bias1)
                p.copy_(weight.to(p.dtype))
            else:
                p.addcdiv_(m.to(p.device), denom.to(p.device), value=-opts["lr"] / bias1)
            self.write_group(i, state)
            self.steps[i] = t
            del state, weight, m, v, denom  # this group's buffers are garbage now
            if j + self.read_ahead + 1 < len(todo):  # the window moves on by one group
                nxt = todo[j + self.read_ahead + 1]
                pending[nxt] = self.prefetch(nxt)
        self.step_count += 1
        self.write_steps()
        # END SOLUTION
        return loss
