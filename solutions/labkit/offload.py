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

from dataclasses import dataclass

import torch


@dataclass
class _Offloaded:
    """A saved tensor parked in host memory: the copy, where it came from, when the copy is done."""

    host: torch.Tensor
    device: torch.device
    event: object = None  # a torch.cuda.Event on CUDA, None on a CPU


def is_parameter(tensor: torch.Tensor) -> bool:
    """True for a parameter or a view of one (``Linear`` saves ``weight.t()``, a view)."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


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
        host_bytes: bytes of saved tensors offloaded to (or, on a CPU, accounted to) the host.
        device_bytes: bytes of saved tensors left on the device (parameters and small tensors).
        host_count, device_count: how many saved tensors went each way.
    """

    def __init__(self, *, min_bytes: int = 1024):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
        self.min_bytes = min_bytes
        self.host_bytes = self.device_bytes = self.host_count = self.device_count = 0
        self._stream = None  # the side stream for device-to-host copies, made on first use
        super().__init__(self.pack, self.unpack)

    def side_stream(self, device: torch.device):
        """The CUDA stream that carries the copies (one per offloader)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def pack(self, tensor: torch.Tensor):
        """Called by autograd for each tensor it saves; returns what autograd stores instead.

        Parameters (and views of them, see ``is_parameter``) and tensors under ``min_bytes``
        are returned as they are (counted in ``device_bytes``). Any other tensor is counted in ``host_bytes``; on CUDA it is copied
        into a new pinned host tensor on ``side_stream`` (which first waits for the current
        stream, so the data is ready), with ``record_stream`` so the allocator does not reuse
        its device memory before the copy ends and an event recorded after the copy; the
        result is an ``_Offloaded`` holding the host copy. On a CPU the tensor itself plays
        the host copy: ``_Offloaded(tensor, tensor.device)``.

        Args:
            tensor: a tensor autograd saves for backward.
        Returns:
            the tensor itself or an ``_Offloaded`` record.
        """
        # BEGIN SOLUTION 5.5: keep params/small tensors (device_bytes); else count host_bytes and copy to pinned host memory on a side stream (CUDA) or wrap as is (CPU)
        nbytes = tensor.numel() * tensor.element_size()
        if is_parameter(tensor) or nbytes < self.min_bytes:
            self.device_bytes += nbytes
            self.device_count += 1
            return tensor
        self.host_bytes += nbytes
        self.host_count += 1
        if tensor.device.type != "cuda":
            return _Offloaded(tensor, tensor.device)
        stream = self.side_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout,
                               pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return _Offloaded(host, tensor.device, event)
        # END SOLUTION

    def unpack(self, packed) -> torch.Tensor:
        """Called by autograd in backward: turn what ``pack`` returned back into a device tensor.

        On CUDA the current stream waits for the offload copy's event, then copies the host
        tensor back to its device (non-blocking from pinned memory).

        Args:
            packed: what ``pack`` returned.
        Returns:
            a tensor equal to the one saved, on the device it was saved from.
        """
        # BEGIN SOLUTION 5.5: return plain tensors as they are; else wait for the copy's event and copy the host tensor back to its device
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.event is None:
            return packed.host
        torch.cuda.current_stream(packed.device).wait_event(packed.event)
        return packed.host.to(packed.device, non_blocking=True)
        # END SOLUTION


def transfer_seconds(nbytes: float, bandwidth_bytes_per_s: float) -> float:
    """Time to move ``nbytes`` over a link of the given bandwidth (one direction)."""
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s!r}")
    return nbytes / bandwidth_bytes_per_s


def compute_seconds(flops: float, flops_per_s: float) -> float:
    """Time to run ``flops`` at an achieved rate of ``flops_per_s``."""
    if not flops_per_s > 0:
        raise ValueError(f"flops_per_s must be > 0, got {flops_per_s!r}")
    return flops / flops_per_s
