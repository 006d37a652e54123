"""Activation offloading: park saved activations in host memory between forward and backward.

Autograd hands every tensor it saves for backward to ``pack``, and takes it back through
``unpack`` when backward needs it (``torch.autograd.graph.saved_tensors_hooks``). An offloader's
``pack`` copies the tensor to pinned host memory on a side CUDA stream, so the copy overlaps
the next layer's compute and the device copy can be freed; ``unpack`` copies it back. The
device then holds ≈ 0 bytes of saved activations; the price is 2 × bytes / bandwidth of PCIe
traffic per step, free when it hides behind compute: a layer's transfer time
(activation bytes / PCIe bandwidth, ≈ 32 GB/s for PCIe 4.0 x16, ≈ 64 GB/s for 5.0) is
shorter than its compute time (FLOPs / achieved FLOP/s). ZeRO-Offload and ZeRO-Infinity
(Rajbhandari et al. 2021, https://arxiv.org/abs/2104.07857) push states further, to NVMe.

Small tensors (below ``min_bytes``) and parameters (which live on the device anyway) stay
where they are. On a CPU there is no device memory to save: the same hooks only *account* the
bytes by where they would live (``ActivationOffloader.host_bytes`` / ``device_bytes``), so the
bookkeeping runs and is graded everywhere.

Lab 5 (labs/05_activations.ipynb), exercise 5.5; Chapter 5 (book/05_activations.md).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from labkit.validate import non_negative_int, non_negative_number, positive_number


# ==== given: the course's code — read it, call it, don't change it ====

@dataclass
class _Offloaded:
    """One distinct saved tensor parked in host memory (shared by every save of the same data).

    ``host`` is the host copy (on a CPU: the tensor itself); ``shape``/``stride`` rebuild the
    saved view; ``event`` marks the end of the device-to-host copy (CUDA); ``prefetched`` is the
    device copy brought back ahead of its use, with ``ready``, the event that ends that copy.
    """

    host: torch.Tensor
    device: torch.device
    contiguous: bool
    shape: tuple
    event: object = None  # a torch.cuda.Event on CUDA, None on a CPU
    prefetched: object = None
    ready: object = None
    index: int = 0
    saves: int = 0
    unpacked: int = 0


@dataclass
class _Saved:
    """What autograd stores for one save: the shared record and this save's own shape."""

    record: _Offloaded
    shape: tuple


def is_parameter(tensor: torch.Tensor) -> bool:
    """True for a parameter or a view of one (``Linear`` saves ``weight.t()``, a view)."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


def data_key(tensor: torch.Tensor) -> tuple:
    """What identifies the data a saved tensor shows: two saves with one key share one copy.

    A dense (contiguous) tensor is its first element's address, its element count and dtype,
    whatever its shape (softmax's output and the reshaped view ``bmm`` saves are one key);
    any other view adds its shape and strides.
    """
    start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
    key = (tensor.device, tensor.dtype, start, tensor.numel())
    return key if tensor.is_contiguous() else key + (tuple(tensor.shape), tuple(tensor.stride()))


# ==== exercise 5.5: your code ====

class ActivationOffloader(torch.autograd.graph.saved_tensors_hooks):
    """Offload the tensors autograd saves inside ``with ActivationOffloader():`` to the host.

    Use it around the forward pass only; backward brings the tensors back by itself::

        offloader = ActivationOffloader(min_bytes=1024)
        with offloader:
            loss = model(x, y)
        loss.backward()
        offloader.host_bytes, offloader.device_bytes

    Args:
        min_bytes: saved tensors smaller than this stay on the device (the copy would cost
            more in launch overhead than it saves).
    Attributes:
        host_bytes: bytes copied to (or, on a CPU, accounted to) the host: each distinct saved
            tensor once (``data_key``), a view by its own elements, not its whole storage.
        host_count: how many distinct tensors were copied to the host.
        shared_count: saves that found their data already copied (no second copy).
        device_bytes, device_count: saved tensors left on the device (parameters, small
            tensors), every save counted.
    """

    def __init__(self, *, min_bytes: int = 1024):
        self.min_bytes = non_negative_int("min_bytes", min_bytes)
        self.host_bytes = self.device_bytes = self.host_count = self.device_count = 0
        self.shared_count = 0
        self._stream = None  # the side stream for copies, made on first use
        self._copies: dict[tuple, tuple[weakref.ref, _Offloaded]] = {}
        self._order: list[_Offloaded] = []  # the host copies, in the order forward made them
        super().__init__(self.pack, self.unpack)

    def __enter__(self):
        self._copies.clear()  # a new forward: addresses of the last one mean nothing now
        self._order.clear()
        return super().__enter__()

    def side_stream(self, device: torch.device):
        """The CUDA stream that carries the copies (one per offloader)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def pack(self, tensor: torch.Tensor):
        """Called by autograd for each tensor it saves; returns what autograd stores instead.

        Contract: parameters (and views of them, see ``is_parameter``) and tensors under
        ``min_bytes`` are returned as they are (``device_bytes``/``device_count``). Any other
        tensor is parked on the host once per distinct data (``data_key``): a second save of
        the same data reuses the first record (``shared_count``). On CUDA the copy goes to
        pinned host memory on ``side_stream`` without racing the compute stream (the copy
        must not start before the tensor is written, and the device memory must not be reused
        before the copy has read it); on a CPU the tensor itself plays the host copy.

        Args:
            tensor: a tensor autograd saves for backward.
        Returns:
            the tensor itself or a ``_Saved`` record (its data's ``_Offloaded`` and its shape).
        """
        raise NotImplementedError("exercise 5.5: keep params/small tensors (device_bytes); else one host copy per distinct data (pinned, side stream, synchronised on CUDA; the tensor itself on a CPU) (labs/05_activations.ipynb)")

    def _bring_back(self, record: _Offloaded) -> None:
        """Start copying ``record`` back to its device on the side stream (a prefetch)."""
        stream = self.side_stream(record.device)
        stream.wait_event(record.event)  # the host copy must be complete
        with torch.cuda.stream(stream):
            record.prefetched = record.host.to(record.device, non_blocking=True)
            record.ready = torch.cuda.Event()
            record.ready.record(stream)

    def unpack(self, packed) -> torch.Tensor:
        """Called by autograd in backward: turn what ``pack`` returned back into a device tensor.

        Contract: returns a tensor equal to the one saved, on the device it was saved from,
        safe to read on the current stream. On CUDA, the copy of the saved tensor that
        backward will need next (the one forward saved just before) starts on the side stream
        now, so it overlaps this step's compute (a prefetch).

        Args:
            packed: what ``pack`` returned.
        Returns:
            the saved tensor (same values, shape and device).
        """
        raise NotImplementedError("exercise 5.5: plain tensors as they are; on CUDA use the prefetched copy (or copy back now) after waiting for its event, then prefetch the previous record (labs/05_activations.ipynb)")


# ==== given: the course's code — read it, call it, don't change it ====

def transfer_seconds(nbytes: float, bandwidth_bytes_per_s: float) -> float:
    """Time to move ``nbytes`` (>= 0) over a link of the given bandwidth (> 0), one direction."""
    nbytes = non_negative_number("nbytes", nbytes)
    return nbytes / positive_number("bandwidth_bytes_per_s", bandwidth_bytes_per_s)


def compute_seconds(flops: float, flops_per_s: float) -> float:
    """Time to run ``flops`` (>= 0) at an achieved rate of ``flops_per_s`` (> 0)."""
    flops = non_negative_number("flops", flops)
    return flops / positive_number("flops_per_s", flops_per_s)
