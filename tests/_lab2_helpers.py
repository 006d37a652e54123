"""Helpers the graders of Lab 2 share (tests/test_lab2_*.py); not collected.

References nobody in this course wrote are computed by the tests that use them; here are the
models, the loops and the comparisons they share, and ``StrictDevices``, the CPU's stand-in for
CUDA's rule that one op's tensors live on one device.
"""
from __future__ import annotations

import copy
import math

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from labkit.models import GPT, GPTConfig, SyntheticData

# fp32 rounding of the same formula with reductions in another order (mean of G² as
# norm²/n or as mean(G·G); RMS(θ); the all-reduce's sum order): a few ulps of numbers ≤ ~1.
UPDATE_TOL = dict(atol=1e-6, rtol=1e-5)
BF16_TOL = dict(atol=1e-5, rtol=2 ** -7)  # one bf16 ulp: the master rounded either way
STEPS = 3


def tiny_gpt(seed: int = 0, dtype=torch.float32, **overrides) -> GPT:
    """A GPT small enough for a few steps in well under a second on a CPU."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg)).to(dtype)


def data():
    return SyntheticData(64, 32, 4, seed=1)


def train(model, optimizer, batches, steps, *, start=0):
    """Plain loop: forward, backward, ``optimizer.step()`` (skipped when None), zero_grad."""
    losses = []
    for i in range(start, start + steps):
        x, y = batches.batch(i)
        loss = model(x, y)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def assert_params_close(got_model, want_model, tol, cause, steps=STEPS):
    """Each parameter of ``got_model`` keeps its dtype and equals ``want_model``'s (Adam with its
    state in memory after ``steps`` steps) within ``tol``; ``cause`` is the likely mistake."""
    for (name, a), b in zip(got_model.named_parameters(), want_model.parameters()):
        assert a.dtype == b.dtype, f"{name} is {a.dtype} after the step, expected {b.dtype}: keep the parameter's dtype"
        torch.testing.assert_close(a.detach(), b.detach(), **tol, msg=lambda m, name=name: (
            f"{name} after {steps} steps differs from Adam with its state in memory: {m} — {cause}"))


def assert_models_close(model_a, model_b, **tol):
    for (name, a), (_, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")


def one_param():
    return [torch.nn.Parameter(torch.zeros(3))]


def reference_adam(model, steps, *, start=0, **adam):
    """Adam with its state in memory: on fp32 parameters directly; on 16-bit ones through an
    fp32 master copy (gradients cast to fp32, the updated master rounded back)."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    mixed = params[0].dtype != torch.float32
    master = [p.detach().float().clone() for p in params] if mixed else params
    opt = torch.optim.Adam(master, **adam)
    batches = data()
    for i in range(start, start + steps):
        model(*batches.batch(i)).backward()
        if mixed:
            for m, p in zip(master, params):
                m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, params):
                if mixed:
                    p.copy_(m.to(p.dtype))
                p.grad = None
    return model, opt, master


def late_gradient_run(make, steps=3, *, dtype=torch.float32, lr=0.1, groups=None, seed=0):
    """Two parameters ``a`` (4×6) and ``b`` (6,): ``a`` gets a gradient at every step, ``b`` only
    from step 2 on (its first gradient arrives late). ``make(params)`` builds the optimizer;
    ``groups``: build it from [{"params": [a], **groups[0]}, {"params": [b], **groups[1]}].
    Returns (a, b, [(a, b) after each step]) — the parameters, detached."""
    g = torch.Generator().manual_seed(seed)
    a = torch.nn.Parameter(torch.randn(4, 6, generator=g).to(dtype))
    b = torch.nn.Parameter(torch.randn(6, generator=g).to(dtype))
    grads = [(torch.randn(4, 6, generator=g), torch.randn(6, generator=g)) for _ in range(steps)]
    opt = make([{"params": [a], **groups[0]}, {"params": [b], **groups[1]}] if groups else [a, b])
    b._opt, b._grads = opt, [gb.to(dtype) for _, gb in grads]  # for tests that look at the state
    history = []
    for step, (ga, gb) in enumerate(grads):
        a.grad = ga.to(dtype)
        b.grad = gb.to(dtype) if step >= 1 else None
        opt.step()
        history.append((a.detach().clone(), b.detach().clone()))
        a.grad = b.grad = None
    return opt, a, b, history


def heavy_tailed(*shape, seed=0):
    """Values over many orders of magnitude, like Adam's moments."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.rand(*shape, generator=g) ** 6


def brute_force_quantize(x, code, block_size):
    """The plain definition: per-block absmax, then the index of the nearest code entry."""
    n = x.numel()
    blocks = math.ceil(n / block_size)
    flat = torch.zeros(blocks * block_size)
    flat[:n] = x.reshape(-1).float()
    flat = flat.view(blocks, block_size)
    absmax = flat.abs().amax(dim=1)
    normalized = flat / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    index = (normalized[..., None] - code).abs().argmin(dim=-1)  # first of equal distances
    return index.reshape(-1)[:n].view(x.shape), absmax


# Ops CUDA lets mix devices in: copies between devices, and indexing a tensor with CPU indices.
_CROSS_DEVICE_OK = {"copy_", "to", "cpu", "cuda", "__setitem__", "new_tensor", "new_zeros",
                    "new_ones", "new_empty", "new_full", "__get__", "__set__", "device", "dtype",
                    "shape", "dim", "numel", "element_size", "size", "is_floating_point", "__repr__",
                    "__format__", "tolist", "numpy", "item", "data_ptr", "untyped_storage"}

# Kernels that take no 0-dim CPU scalar: CUDA's fused optimizers read every tensor argument
# (state_steps included) through device pointers, with no device check (a CPU step count is an
# illegal memory access, PyTorch's multi_tensor_apply_for_fused_optimizer); the AMP kernels
# refuse a CPU found_inf or inv_scale ("found_inf must be a CUDA tensor").
_NO_HOST_SCALARS = {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_",
                    "_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_"}


class StrictDevices(TorchFunctionMode):
    """Raise, as CUDA does, when one op gets tensors on two devices.

    On a CPU every tensor is on the same device, so code that indexes a CPU code table with GPU
    codes, or compares GPU values with CPU midpoints, passes every CPU test and raises on the
    GPU. Under this mode, with the data on the ``meta`` device and the tables on the CPU, the same
    code raises here: an op whose tensor arguments (0-dim CPU scalars aside, which CUDA accepts)
    sit on more than one device is refused, except copies between devices and indexing with
    CPU indices, which CUDA allows; the fused optimizer and AMP kernels (``_NO_HOST_SCALARS``)
    take no 0-dim CPU scalar either.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name not in _CROSS_DEVICE_OK:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if name == "__getitem__" and tensors:  # indices may be on the CPU
                base = tensors[0].device
                bad = {t.device for t in tensors[1:] if t.device != base and t.device.type != "cpu"}
                devices = {base} | bad if bad else {base}
            elif name in _NO_HOST_SCALARS:  # every tensor on the one device, 0-dim ones too
                devices = {t.device for t in tensors}
            else:
                devices = {t.device for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
            if len(devices) > 1:
                on_gpu = ("its CUDA kernel reads the CPU tensor through a device pointer (an illegal "
                          "memory access) or refuses it" if name in _NO_HOST_SCALARS else
                          "this raises (Expected all tensors to be on the same device)")
                raise RuntimeError(f"{name} mixes tensors on {sorted(map(str, devices))}: on a GPU {on_gpu}")
        return func(*args, **kwargs)
