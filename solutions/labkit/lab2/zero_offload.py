"""ZeRO-Offload: the optimizer states and the Adam step live on the host, not on the GPU.

Mixed-precision Adam keeps 16 bytes a parameter on the GPU: 2 (16-bit weights) + 2 (16-bit
gradients) + 12 (the fp32 master copy and Adam's m and v). ZeRO-Offload (Ren et al. 2021,
"ZeRO-Offload: Democratizing Billion-Scale Model Training", arXiv 2101.06840) moves the 12 to
host memory and the update to the CPU, which is fast enough for an elementwise step:

* forward and backward run on the GPU with the 16-bit weights, as before;
* each gradient is copied to a host buffer *as soon as backward has finished it* (a
  post-accumulate-grad hook), on a side CUDA stream into pinned memory, so the copies overlap
  the rest of backward, and the device gradient is freed at once;
* the step runs on the host: ``torch.optim.Adam`` (``fused``: vectorized over all tensors) over
  fp32 master weights in host memory;
* the updated master weights, rounded to the 16-bit dtype, are copied back to the device.

Device memory: 2Ψ of weights plus a gradient in flight instead of 16Ψ; the link carries 2Ψ
bytes each way per step (16-bit gradients down, 16-bit weights up). ZeRO-Offload keeps the
16-bit *parameters* on the GPU; only ZeRO-Infinity also offloads parameters, and uses NVMe
(``labkit.lab2.nvme_offload``).

On a CPU-only machine "device" and "host" are the same memory: the same code runs and is
graded on the numerics, the order of events and where each tensor's storage is: a host
buffer must be the offloader's own (allocated once, pinned on CUDA), never the device gradient
itself. ``labkit.harness.lab2.memory_by_location`` accounts the bytes by location.

Chapter 2 (book/02_optimizer_states.md); Lab 2, exercise 2.6 (labs/02_optimizer_states.ipynb).
"""
from __future__ import annotations

import torch

from labkit.host_offload import HostOffload
from labkit.optim_base import run_closure

# ==== given: the course's code — read it, call it, don't change it ====


class ZeROOffload(HostOffload):
    """Adam for a model on the device, with its master weights, m, v and step on the host.

    Use it in place of an optimizer; several backward passes before one ``step()`` add up, as
    ``.grad`` would::

        offload = ZeROOffload(model, lr=1e-3)
        loss = model(x, y); loss.backward()   # gradients leave the device during backward
        offload.step()                        # Adam on the host, weights copied back

    Set up by ``labkit.host_offload.HostOffload`` (given), and used by the exercise:
        params, names: the model's trainable parameters (a tied weight once) and their names.
        master: host copies of the parameters (fp32; fp64 for fp64 parameters; pinned on CUDA);
            ``optim``, a ``torch.optim.Adam`` over them: its m, v and step counters are host
            tensors.
        host_grads: one host buffer per parameter, in the parameter's dtype (pinned on CUDA):
            the 16-bit gradient is what crosses the link.
        stream: the side CUDA stream for the copies (None on a CPU); ``copied``: per parameter,
            the CUDA event that ends its copy (None on a CPU).
        arrived: indices of the parameters whose gradient reached the host since the last step
            (``zero_grad()`` empties it).
        events: ``("grad to host", name)`` appended after each gradient's hook returns (a test or
            the lab may append its own events, e.g. the start of each block's backward).
    ``zero_grad``, ``state_dict``/``load_state_dict``, ``check_trainable`` (``step`` calls it
    first: a parameter unfrozen since construction is refused, by name) and ``remove`` are given too.

    Args:
        model: the module to train (on a CPU or one CUDA device).
        lr, betas, eps, weight_decay: ``torch.optim.Adam``'s.
    """

    # ==== exercise 2.6: your code ====

    def _offload_grad(self, param: torch.Tensor) -> None:
        """Called by autograd once ``param.grad`` is complete, in the middle of backward.

        Contract: the gradient's values end up in this parameter's host buffer, filled in place
        (``self.host_grads[i]`` stays the buffer allocated here: a "host buffer" that is the
        device gradient itself would leave it on the GPU; on CUDA: copied
        on ``self.stream`` without racing the compute stream that wrote it, and ``self.copied``
        holds an event that marks the end of the copy; the device memory must not be reused
        before the copy has read it); if this parameter's gradient already arrived since the
        last step (a second backward before ``step()``), the buffer ends up holding the sum, as
        ``.grad`` would; the parameter's index is added to ``self.arrived``, and the device
        gradient is released before this returns (``param.grad`` is None).
        """
        # BEGIN SOLUTION 2.6: move this parameter's finished gradient into its host buffer (CUDA: side stream, event, no race), or add it to what arrived earlier, note that it arrived, release the device gradient
        i = self.index[id(param)]
        grad = param.grad
        if i in self.arrived:  # a later backward before step(): add, as .grad would
            if self.copied[i] is not None:
                self.copied[i].synchronize()  # the earlier copy has landed
            self.host_grads[i].add_(grad.to(self.host_grads[i].device))
        elif self.stream is None:
            self.host_grads[i].copy_(grad)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # grad is written
            with torch.cuda.stream(self.stream):
                self.host_grads[i].copy_(grad, non_blocking=True)
                grad.record_stream(self.stream)  # not reused before the copy has read it
                self.copied[i] = torch.cuda.Event()
                self.copied[i].record(self.stream)
        self.arrived.add(i)
        param.grad = None
        # END SOLUTION

    @torch.no_grad()
    def step(self, closure=None):
        """Adam on the host for every parameter whose gradient arrived since the last step.

        Contract: after it returns, each such parameter (on the device, in its own dtype) equals
        its master weight after one ``torch.optim.Adam`` step on the gradient it received (cast
        to the master's dtype), rounded to the parameter's dtype, exactly as on-device
        mixed-precision Adam would leave it; parameters without a gradient this step are not
        touched (Adam skips them, and their step counts do not advance); the optimizer's state
        stays on the host; ``arrived`` is empty again. ``closure`` (optional, given) runs first,
        as for ``torch.optim``; its loss is returned.
        """
        loss = run_closure(closure)
        self.check_trainable()  # given: refuses a parameter unfrozen since construction
        # BEGIN SOLUTION 2.6: wait for the copies, step the host optimizer on the arrived gradients (fp32), write the rounded master weights back to the device, reset arrived
        for i, master in enumerate(self.master):
            if i in self.arrived:
                if self.copied[i] is not None:
                    self.copied[i].synchronize()  # the host buffer is complete
                master.grad = self.host_grads[i].to(master.dtype)
            else:
                master.grad = None
        self.optim.step()
        for i in sorted(self.arrived):
            self.params[i].copy_(self.master[i].to(self.params[i].dtype))
            self.master[i].grad = None
        self.arrived.clear()
        # END SOLUTION
        return loss
