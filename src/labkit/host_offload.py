"""The machinery under ZeRO-Offload (Lab 2, exercise 2.6): host copies, host buffers, a side
stream and the hooks that call the exercise.

:class:`HostOffload` sets up, for a model on one device (a CPU or one CUDA device):

* ``master``: one host copy per trainable parameter, in the master dtype (fp32 for fp32 and
  16-bit parameters, fp64 for fp64 ones: ``labkit.flat_params.master_dtype``), pinned on CUDA;
* ``optim``: ``torch.optim.Adam(fused=True)`` over the masters — PyTorch's vectorized CPU Adam
  (the counterpart of DeepSpeed's CPU-Adam), so m, v and the step counts are host tensors;
* ``host_grads``: one host buffer per parameter, in the parameter's dtype (pinned on CUDA);
* ``stream`` (a side CUDA stream for the copies, None on a CPU) and ``copied`` (per parameter,
  the CUDA event that ends its last copy);
* a post-accumulate-grad hook per parameter that calls the subclass's ``_offload_grad(param)``
  and appends ``("grad to host", name)`` to ``events``.

It also gives what an optimizer needs around the step: ``zero_grad`` (discards the gradients
that reached the host since the last step, as ``.grad = None`` would), ``state_dict`` /
``load_state_dict`` (the masters and the host Adam's state: a checkpoint resumes exactly) and
``remove``.
"""
from __future__ import annotations

import torch

from labkit.flat_params import master_dtype
from labkit.optim_base import refuse_sparse_grad, refuse_unfrozen
from labkit.validate import adam_args

__all__ = ["HostOffload"]


class HostOffload:
    """Host masters, host gradient buffers, a side stream and hooks for a model (see the module).

    Args:
        model: the module to train (on a CPU or one CUDA device); its trainable parameters
            (``requires_grad``), a tied weight once.
        lr, betas, eps, weight_decay: ``torch.optim.Adam``'s, checked before anything moves.
    """

    def __init__(self, model: torch.nn.Module, *, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        adam_args(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("model must have at least one parameter that requires grad")
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"model's parameters must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        for name, p in named:
            master_dtype(p.dtype, name=f"parameter {name!r}")  # floating point only
        self.index = {id(p): i for i, p in enumerate(self.params)}
        cuda = self.device.type == "cuda"
        host = torch.device("cpu")
        # contiguous masters (as the host buffers): the fused Adam pairs a master and its
        # gradient element by element in memory, so their layouts must agree even where a
        # parameter is a non-contiguous view (a transposed weight)
        self.master = [p.detach().to(host, master_dtype(p.dtype), copy=True,
                                     memory_format=torch.contiguous_format) for p in self.params]
        self.host_grads = [torch.empty(p.shape, dtype=p.dtype, device=host) for p in self.params]
        if cuda:  # page-locked host memory: the DMA engine copies while the GPU computes
            self.master = [m.pin_memory() for m in self.master]
            self.host_grads = [g.pin_memory() for g in self.host_grads]
        self.optim = torch.optim.Adam(self.master, lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, fused=True)
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.copied: list = [None] * len(self.params)
        self.arrived: set[int] = set()
        self.had_grad: set[int] = set()  # the parameters that have had a gradient
        self.events: list[tuple[str, str]] = []
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _on_grad(self, param: torch.Tensor) -> None:
        refuse_sparse_grad(param.grad, type(self).__name__)
        self.had_grad.add(self.index[id(param)])
        self._offload_grad(param)
        self.events.append(("grad to host", self.names[self.index[id(param)]]))

    def _offload_grad(self, param: torch.Tensor) -> None:
        raise NotImplementedError  # pragma: no cover - the subclass writes it

    def check_trainable(self) -> None:
        """Refuse, naming them, parameters frozen when this was built and unfrozen since: their
        hooks and host masters are made at construction, so they would silently not be trained
        (``labkit.optim_base.refuse_unfrozen``)."""
        refuse_unfrozen(self.frozen, type(self).__name__)

    def wait_for_copies(self) -> None:
        """Block until every gradient copy issued so far has reached its host buffer."""
        for event in self.copied:
            if event is not None:
                event.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients that reached the host since the last step (the device gradients
        were released during backward): the next step sees only what arrives after this call.
        With ``set_to_none=False`` a parameter that has had a gradient is left a zero one, as
        ``torch.optim``'s: the next step updates it even if no backward reaches it."""
        self.wait_for_copies()
        self.arrived.clear()
        if not set_to_none:
            for i in self.had_grad:
                self.host_grads[i].zero_()
                self.arrived.add(i)

    def state_dict(self) -> dict:
        """The masters and the host Adam's state (``torch.optim.Adam.state_dict``)."""
        return {"master": [m.detach().clone() for m in self.master],
                "optim": self.optim.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume from ``state_dict()``: the masters, the host Adam's state, and the device
        parameters rounded from the masters."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"master", "optim"}:
            raise ValueError("state_dict must be what state_dict() returned: a dict with "
                             "'master' and 'optim'")
        masters = state_dict["master"]
        if len(masters) != len(self.master) or any(
                a.shape != b.shape for a, b in zip(masters, self.master)):
            raise ValueError("state_dict holds the state of other parameters (their number or "
                             "shapes differ)")
        self.optim.load_state_dict(state_dict["optim"])
        with torch.no_grad():
            for m, saved, p in zip(self.master, masters, self.params):
                m.copy_(saved)
                p.copy_(m.to(p.dtype))

    def remove(self) -> None:
        """Remove the hooks: backward goes back to leaving gradients in ``.grad``."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
