"""The state files under NVMe offload (Lab 2, exercise 2.7): one file per parameter, read ahead
on an I/O thread, written back, with every byte counted.

:class:`StateFiles` keeps, for each parameter (a *group*), the file ``group_XXXX.bin`` of its
Adam state, K·n numbers in the state dtype (``labkit.flat_params.master_dtype``: fp32 for fp32
and 16-bit parameters, fp64 for fp64 ones): [master (16-bit parameters only), m, v]; and
``step.json``, the count of ``step()`` calls and each parameter's own step count, with the
layout (sizes and dtypes). The files are read and written explicitly (``prefetch`` /
``write_group``), not memory-mapped: an mmap's pages are resident at the kernel's discretion,
while an explicit read makes "resident bytes" a number we can count. A directory that already
holds this layout is resumed: the files are the checkpoint.

``labkit.lab2.nvme_offload.NVMeAdam`` (the exercise) is its subclass with the step.
"""
from __future__ import annotations

import json
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from labkit import validate
from labkit.flat_params import master_dtype
from labkit.optim_base import param_groups, refuse_sparse_grad

__all__ = ["ADAM_OPTIONS", "LAYOUT", "Prefetch", "StateFiles"]

LAYOUT = "labkit.lab2.nvme_offload/3"  # /3: the state dtype follows labkit.flat_params.master_dtype
ADAM_OPTIONS = ("lr", "betas", "eps", "weight_decay")


class Prefetch:
    """A read in flight. ``result()`` waits for it and hands the group's state over, once: the
    handle keeps no reference afterwards, so the buffers live exactly as long as the caller
    keeps them."""

    def __init__(self, future: Future, box: list):
        self._future, self._box = future, box

    def result(self) -> dict[str, torch.Tensor]:
        self._future.result()  # waits; re-raises an error of the read
        state, self._box[0] = self._box[0], None
        if state is None:
            raise RuntimeError("this prefetch's state was already taken: call result() once")
        return state


class StateFiles:
    """Adam's state (per parameter: master, m, v and a step count) in files under ``directory``.

    A new directory is filled with the initial state (master = the parameters, m = v = 0); a
    directory that already holds this layout (same tensor sizes and dtypes) is *resumed*: its
    master weights, moments and step count continue where they were written.

    Infrastructure (given; the exercise uses it):
        groups: the parameters, one tensor per group (a tied weight once).
        state_dtype[i]: the dtype of group i's state (fp32; fp64 for an fp64 parameter);
            ``has_master[i]``: whether the file holds a master (16-bit parameters);
            ``K[i]``: state bytes per element (8 or 12 in fp32, 16 in fp64).
        options[i]: group i's Adam options, ``{"lr", "betas", "eps", "weight_decay"}`` (the
            keyword arguments, or the parameter group's own where ``params`` has groups).
        steps[i]: the steps group i has taken (its own count, for its bias corrections).
        prefetch(i): start reading group i's state on the I/O thread; returns a ``Prefetch``
            whose ``result()`` waits and hands over ``{"master"?, "exp_avg", "exp_avg_sq"}``
            (tensors of the parameter's shape in ``state_dtype[i]``; "master" only for 16-bit
            parameters), once.
        write_group(i, state): write that dict back to group i's file.
        write_steps(): record ``step_count`` and ``steps`` in ``step.json``.
        bytes_read, bytes_written: state bytes moved so far (counted by read/write).
        resident_bytes, peak_resident_bytes: bytes of state buffers read and still alive in
            host memory, now and at most (each buffer is counted until it is garbage).
        events: ``("read", i)`` when a prefetch is issued, ``("write", i)`` when a write ends.
        step_count: calls of ``step()`` so far (read from ``step.json`` on resume).

    Args:
        params: the parameters (each tensor once), or parameter groups (dicts with "params" and
            any of lr, betas, eps, weight_decay), as for ``torch.optim.Adam``.
        directory: where the state files live (created if missing).
        lr, betas, eps, weight_decay: ``torch.optim.Adam``'s (L2 weight decay, added to the
            gradient).
        read_ahead: how many groups beyond the one being updated may be read at once (≥ 0).
    """

    def __init__(self, params, directory, *, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, read_ahead: int = 1):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        validate.adam_args(**defaults)
        groups = param_groups(params, defaults, allowed=ADAM_OPTIONS,
                              check=lambda o: validate.adam_args(**o))
        params = [p for g in groups for p in g["params"]]
        self.options = [{**{o: g[o] for o in ADAM_OPTIONS}, "betas": tuple(g["betas"])}
                        for g in groups for _ in g["params"]]
        if not all(p.is_floating_point() for p in params):
            raise ValueError("params must be a non-empty iterable of floating-point tensors")
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path (str or os.PathLike), got {type(directory).__name__}")
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"directory must be a directory (existing or new), got the file {os.fspath(directory)!r}")
        self.read_ahead = validate.non_negative_int("read_ahead", read_ahead)
        self.groups = params
        self.directory = os.fspath(directory)
        self.state_dtype = [master_dtype(p.dtype, name="params' dtype") for p in params]
        self.has_master = [p.dtype != d for p, d in zip(params, self.state_dtype)]
        self.K = [d.itemsize * (3 if m else 2)  # state bytes per element
                  for d, m in zip(self.state_dtype, self.has_master)]
        self.bytes_read = self.bytes_written = 0
        self.resident_bytes = self.peak_resident_bytes = 0
        self.events: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-io")
        self._finalizer = weakref.finalize(self, self._io.shutdown, wait=False)
        os.makedirs(self.directory, exist_ok=True)
        layout = {"layout": LAYOUT, "groups": [[list(p.shape), str(p.dtype)] for p in params]}
        meta_path = os.path.join(self.directory, "step.json")
        if os.path.exists(meta_path):
            try:
                with open(meta_path) as f:
                    meta = json.load(f)
            except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
                meta = None
            if not isinstance(meta, dict) or not all(k in meta for k in ("step", "steps")):
                raise ValueError(f"directory {self.directory!r} holds a step.json that is not "
                                 "NVMeAdam's (unreadable, or another tool's): use a new directory")
            if {k: meta.get(k) for k in layout} != layout:
                raise ValueError(f"directory {self.directory!r} holds the state of other parameters "
                                 "(shapes or dtypes differ): use a new directory")
            self.step_count = int(meta["step"])
            self.steps = [int(s) for s in meta["steps"]]
        else:
            for i, p in enumerate(params):
                dtype = self.state_dtype[i]
                state = {"exp_avg": torch.zeros(p.shape, dtype=dtype),
                         "exp_avg_sq": torch.zeros(p.shape, dtype=dtype)}
                if self.has_master[i]:
                    state["master"] = p.detach().to("cpu", dtype)
                self._write(i, state)
            self.step_count = 0
            self.steps = [0] * len(params)
            self.write_steps()
        self._layout = layout

    def check_gradients(self) -> None:
        """Refuse a sparse gradient before any group is updated (``nn.Embedding(sparse=True)``
        makes one; ``torch.optim.Adam`` refuses it too), naming the optimizer: step calls this
        first, so a refused step leaves every file as it was."""
        for p in self.groups:
            if p.grad is not None:
                refuse_sparse_grad(p.grad, type(self).__name__)

    def path(self, i: int) -> str:
        """The file of group i."""
        return os.path.join(self.directory, f"group_{i:04d}.bin")

    def _keys(self, i: int) -> list[str]:
        return (["master"] if self.has_master[i] else []) + ["exp_avg", "exp_avg_sq"]

    def _read(self, i: int) -> dict[str, torch.Tensor]:
        p = self.groups[i]
        n = p.numel()
        flat = torch.empty(len(self._keys(i)) * n, dtype=self.state_dtype[i])
        with self._lock:  # resident from allocation until the last view of it is garbage
            self.resident_bytes += flat.nbytes
            self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        weakref.finalize(flat, self._release, flat.nbytes)  # views keep their base alive
        with open(self.path(i), "rb") as f:
            got = f.readinto(flat.numpy())
        if got != flat.nbytes:
            raise OSError(f"{self.path(i)}: read {got} bytes, expected {flat.nbytes}")
        with self._lock:
            self.bytes_read += got
        return {k: flat[j * n:(j + 1) * n].view(p.shape) for j, k in enumerate(self._keys(i))}

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.resident_bytes -= nbytes

    def _write(self, i: int, state: dict[str, torch.Tensor]) -> int:
        keys = self._keys(i)
        if not isinstance(state, dict) or set(state) != set(keys):
            raise ValueError(f"state of group {i} must be a dict with keys {keys}, got "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
        flat = torch.cat([state[k].detach().reshape(-1).to("cpu", self.state_dtype[i]) for k in keys])
        path = self.path(i)
        # overwrite in place ("r+b"): truncating and regrowing a file costs far more than writing it
        with open(path, "r+b" if os.path.exists(path) else "wb") as f:
            f.write(memoryview(flat.numpy()))
        return flat.nbytes

    def prefetch(self, i: int) -> "Prefetch":
        """Start reading group i's state on the I/O thread (see the class docstring)."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.groups):
            raise ValueError(f"i must be a group index in [0, {len(self.groups)}), got {i!r}")
        self.events.append(("read", i))
        box: list = [None]

        def read() -> None:  # the pool's Future holds None: only the handle holds the buffers
            box[0] = self._read(i)

        return Prefetch(self._io.submit(read), box)

    def write_group(self, i: int, state: dict[str, torch.Tensor]) -> None:
        """Write group i's updated state back to its file (blocking)."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.groups):
            raise ValueError(f"i must be a group index in [0, {len(self.groups)}), got {i!r}")
        nbytes = self._write(i, state)
        with self._lock:
            self.bytes_written += nbytes
        self.events.append(("write", i))

    def write_steps(self) -> None:
        """Record ``step_count`` and every group's ``steps`` (with the layout) in ``step.json``,
        atomically."""
        meta_path = os.path.join(self.directory, "step.json")
        with open(meta_path + ".tmp", "w") as f:
            json.dump({"layout": LAYOUT, "groups": [[list(p.shape), str(p.dtype)] for p in self.groups],
                       "step": int(self.step_count), "steps": [int(s) for s in self.steps]}, f)
        os.replace(meta_path + ".tmp", meta_path)

    def window_bytes(self) -> int:
        """The most state bytes the read-ahead window can hold: K·numel over the largest
        ``read_ahead + 1`` consecutive groups."""
        sizes = [k * p.numel() for k, p in zip(self.K, self.groups)]
        w = min(self.read_ahead + 1, len(sizes))
        return max(sum(sizes[i:i + w]) for i in range(len(sizes) - w + 1))

    def state_bytes_formula(self) -> int:
        """K·Ψ: the bytes one step reads (and writes): Σ K·numel over the groups."""
        return sum(k * p.numel() for k, p in zip(self.K, self.groups))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Release the parameters' gradients (or zero them), as ``torch.optim.Optimizer.zero_grad``."""
        for p in self.groups:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def close(self) -> None:
        """Stop the I/O thread (the files stay)."""
        self._io.shutdown(wait=True)
