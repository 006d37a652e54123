"""Graders of Lab 3, exercise 3.2 (labs/03_parameters.ipynb): mixed-precision Adam with fp32
master weights.

References nobody in this course wrote: ``torch.optim.Adam`` on an fp32 copy of the weights fed
the same gradients (cast to fp32), then cast to the 16-bit dtype; ``MemTracker`` (via
``labkit.measure.measure_step``) and ``labkit.optimizer_states.state_bytes`` for the bytes,
against the formula 2 + 2 + 12 bytes per parameter.

Tolerances: the master after 5 steps agrees with torch's fp32 Adam to fp32 rounding of the same
formula (atol 1e-6 for weights ≤ ~1, rtol 1e-5); the 16-bit parameter is the master rounded to
16 bits, so it must equal the *reference* master rounded except where the two masters straddle a
rounding boundary: at most one 16-bit ulp apart (checked), on a tiny share of elements. Byte
counts are exact.
"""
from __future__ import annotations


import pytest
import torch

from labkit.measure import measure_step
from labkit.models import GPT, GPTConfig, SyntheticData
from labkit.optimizer_states import state_bytes
from _given import assert_state_kept_in_state


def tiny_gpt(dtype):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)).to(dtype)


def lockstep(dtype, steps=5, lr=1e-3):
    """Train a 16-bit GPT with MixedPrecisionAdam; feed the same fp32-cast gradients to
    torch.optim.Adam on fp32 copies. Returns (model, opt, fp32 reference params)."""
    from labkit.lab3.mixed_precision import MixedPrecisionAdam

    model = tiny_gpt(dtype)
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = MixedPrecisionAdam(model.parameters(), lr=lr)
    ref_opt = torch.optim.Adam(ref, lr=lr)
    data = SyntheticData(64, 16, 4, seed=1)
    for i in range(steps):
        x, y = data.batch(i)
        model(x, y).backward()
        for p, q in zip(model.parameters(), ref):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, ref


def assert_masters_equal(model, opt, ref, when=""):
    """Each parameter's state["master"] must be fp32 and equal torch.optim.Adam's fp32 copy
    (tolerance: the module docstring's)."""
    for (name, p), q in zip(model.named_parameters(), ref):
        master = opt.state[p].get("master")
        assert master is not None and master.dtype == torch.float32, (
            f"{name}{when}: state['master'] is {None if master is None else master.dtype}, expected an fp32 tensor")
        torch.testing.assert_close(master, q.detach(), atol=1e-6, rtol=1e-5, msg=lambda m, name=name: (
            f"{name}{when} master vs fp32 Adam: {m} — is the update applied to the fp32 master (not to the "
            "16-bit parameter), with the gradient cast to fp32 and bias correction?"))


@pytest.mark.exercise("3.2", points=2)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_master_weights_equal_fp32_adam(dtype):
    """Check the fp32 master after 5 steps equals torch.optim.Adam on fp32 copies fed the same
    gradients."""
    model, opt, ref = lockstep(dtype)
    assert_masters_equal(model, opt, ref)


@pytest.mark.exercise("3.2", points=2)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_parameters_are_the_reference_rounded(dtype):
    """Check each 16-bit parameter equals the fp32 reference cast to its dtype (at most one
    16-bit ulp off, on ≤ 1% of elements, where the two masters straddle a rounding boundary), and
    equals the optimizer's own master rounded exactly."""
    model, opt, ref = lockstep(dtype)
    for (name, p), q in zip(model.named_parameters(), ref):
        assert p.dtype == dtype, f"{name} has dtype {p.dtype}, expected it to stay {dtype}"
        want = q.detach().to(dtype)
        off = p != want
        ulp = (want.float().abs() * torch.finfo(dtype).eps).clamp_min(torch.finfo(dtype).tiny)
        far = ~((p.float() - want.float()).abs() <= ulp * 1.01) & off  # NaN is far
        assert not far.any(), (f"{name}: {int(far.sum())} elements differ from fp32 Adam rounded to {dtype} by "
                               "more than one ulp: is p set to the master rounded after every step?")
        assert off.float().mean() <= 0.01, f"{name}: {off.float().mean():.1%} of elements differ by an ulp"
        # exact: after step() the 16-bit parameter IS the optimizer's own master rounded
        own = opt.state[p]["master"].to(dtype)
        lag = p != own
        assert not lag.any(), (f"{name}: {int(lag.sum())} of {p.numel()} elements differ from the "
                               f"optimizer's own fp32 master rounded to {dtype} (e.g. {p[lag][0].item()} vs "
                               f"{own[lag][0].item()}): is p rounded from the master after the update, not before?")


@pytest.mark.exercise("3.2", points=2)
def test_bytes_per_parameter_are_2_2_12():
    """Check MemTracker's bytes after a step of a bf16 GPT: parameters 2Ψ, gradients 2Ψ,
    optimizer states 12Ψ exactly (state_bytes as well); and that the measured step was Adam's
    (its masters equal ``lockstep``'s fp32 Adam after the same first step on the same batch)."""
    from labkit.lab3.mixed_precision import MixedPrecisionAdam

    model = tiny_gpt(torch.bfloat16)
    psi = sum(p.numel() for p in model.parameters())
    opt = MixedPrecisionAdam(model.parameters(), lr=1e-3)
    data = SyntheticData(64, 16, 4, seed=1)
    step = measure_step(model, opt, data.batch(0))
    assert state_bytes(opt) == 12 * psi, (
        f"state_bytes = {state_bytes(opt):,}, expected 12Ψ = {12 * psi:,}: fp32 master, m and v, "
        "nothing else as a tensor (keep 'step' a Python int)")
    assert_state_kept_in_state(opt)
    got = {k: step.after[k] for k in ("parameters", "optimizer states")}
    want = {"parameters": 2 * psi, "optimizer states": 12 * psi}
    assert got == want, f"MemTracker after the step: {got}, expected {want}"
    assert step.peak_of("gradients") == 2 * psi, (
        f"gradients at their peak {step.peak_of('gradients'):,} B, expected 2Ψ = {2 * psi:,}")
    assert_masters_equal(model, opt, lockstep(torch.bfloat16, steps=1)[2], " after the measured step")


@pytest.mark.exercise("3.2", points=1)
def test_small_updates_survive_in_the_master():
    """Check updates far below a bf16 ulp accumulate in the master and eventually move the bf16
    weight, where adding them to the bf16 weight directly loses all of them."""
    from labkit.lab3.mixed_precision import MixedPrecisionAdam

    w = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = MixedPrecisionAdam([w], lr=1e-3)  # bf16 ulp at 1 is 2^-7 ≈ 0.0078: 8 steps < one ulp
    for _ in range(20):
        w.grad = torch.ones_like(w)
        opt.step()
    assert (w < 1).all(), (f"after 20 steps of -1e-3 the bf16 weight is {w[0].item()}, expected < 1 "
                           "(master ≈ 0.98): are the updates accumulated in the fp32 master?")
    plain = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    ref = torch.optim.Adam([plain], lr=1e-3)
    for _ in range(20):
        plain.grad = torch.ones_like(plain)
        ref.step()
    assert (plain == 1).all()  # the plain bf16 Adam loses every update (the contrast the lab shows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_non_16bit_params_raise_value_error(dtype):
    from labkit.lab3.mixed_precision import MixedPrecisionAdam

    with pytest.raises(ValueError, match="params"):
        MixedPrecisionAdam([torch.nn.Parameter(torch.ones(2, dtype=dtype))])


@pytest.mark.exercise("3.2", points=2)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_param_groups_late_and_frozen_parameters_equal_fp32_adam(dtype):
    """Check, against torch.optim.Adam on fp32 copies with the same param groups: a first group
    (wpe alone) that never has a gradient, then two groups with
    their own lr, betas and eps (eps 1e-3, large enough that where it is added shows), block 1's
    parameters first given a gradient at step 2 (each parameter keeps its own step count), and
    wpe never given one (skipped: no state, unchanged). Masters within atol 1e-6, rtol 1e-5 (the
    same fp32 formula; the order of the elementwise operations may differ by an ulp). And
    ln_f.weight has no gradient at step 3 only, while the rest of its group has: that step is
    skipped for it alone (its own count stops, then goes on), as torch's Adam does."""
    from labkit.lab3.mixed_precision import MixedPrecisionAdam

    model = tiny_gpt(dtype)
    named = dict(model.named_parameters())
    ref = {n: p.detach().float().clone().requires_grad_() for n, p in named.items()}
    first = [n for n in named if n.startswith("h.0.")]
    rest = [n for n in named if n not in first]
    hyper = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-3)
    rest.remove("wpe.weight")  # a group of its own, first: a group without any gradient
    groups = [["wpe.weight"], first, rest]
    opt = MixedPrecisionAdam([{"params": [named[n] for n in groups[0]]},
                              {"params": [named[n] for n in first], **hyper},
                              {"params": [named[n] for n in rest]}], lr=1e-3)
    ref_opt = torch.optim.Adam([{"params": [ref[n] for n in groups[0]]},
                                {"params": [ref[n] for n in first], **hyper},
                                {"params": [ref[n] for n in rest]}], lr=1e-3)
    late = {n for n in named if n.startswith("h.1.")}
    data = SyntheticData(64, 16, 4, seed=1)
    for step in range(5):
        x, y = data.batch(step)
        model(x, y).backward()
        for n, p in named.items():
            if n == "wpe.weight" or (step < 2 and n in late) or (step == 3 and n == "ln_f.weight"):
                p.grad = None
            ref[n].grad = None if p.grad is None else p.grad.float()
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
    start = tiny_gpt(dtype)
    assert not opt.state.get(named["wpe.weight"]), (
        "wpe.weight never had a gradient but has optimizer state: skip parameters whose .grad is None")
    assert torch.equal(named["wpe.weight"], dict(start.named_parameters())["wpe.weight"]), \
        "wpe.weight never had a gradient but changed: skip parameters whose .grad is None"
    for n, p in named.items():
        if n == "wpe.weight":
            continue
        assert opt.state.get(p), (f"{n} had gradients but has no optimizer state: does step() go on "
                                  "to the next param group after a group without any gradient?")
        steps = opt.state[p].get("step")
        want_steps = 3 if n in late else 4 if n == "ln_f.weight" else 5
        assert type(steps) is int and steps == want_steps, (
            f"{n}: state['step'] = {steps!r} ({type(steps).__name__}), expected the Python int "
            f"{want_steps} (the contract's type; the steps at which this parameter had a gradient: "
            "a step where it has none does not count, even if others in its group have one)")
        group = "its group's (lr 3e-3, betas (0.8, 0.99), eps 1e-3)" if n in first else "the default"
        torch.testing.assert_close(opt.state[p]["master"], ref[n].detach(), atol=1e-6, rtol=1e-5,
                                   msg=lambda m, n=n, group=group: f"{n} master vs fp32 Adam with "
                                   f"{group} hyperparameters{', first gradient at step 2' if n in late else ''}: {m}")


@pytest.mark.parametrize("kwargs", [dict(eps=-1e-8), dict(betas=(0.9, 1.0)), dict(lr=-1.0),
                                    dict(betas=(0.9,))])
def test_bad_hyperparameters_raise_value_error(kwargs):
    from labkit.lab3.mixed_precision import MixedPrecisionAdam

    p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        MixedPrecisionAdam([p], **kwargs)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        MixedPrecisionAdam([{"params": [p], **kwargs}])


@pytest.mark.exercise("3.2", points=1)
def test_step_keeps_every_tensor_on_the_parameters_device():
    """Check a step of 16-bit parameters on another device than the CPU (``meta`` here, standing
    in for CUDA) under ``StrictDevices``, which raises as CUDA does when one op mixes devices;
    for torch's fused Adam kernel a 0-dim CPU step count counts too (on CUDA the kernel reads it
    through a device pointer: an illegal memory access that kills the notebook's CUDA context).
    Two steps run; the state ends up on the parameters' device."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _lab2_helpers import StrictDevices

    from labkit.lab3.mixed_precision import MixedPrecisionAdam

    params = [torch.nn.Parameter(torch.zeros(*shape, dtype=torch.bfloat16, device="meta"))
              for shape in ((16, 8), (8,))]
    opt = MixedPrecisionAdam(params, lr=1e-3)
    for _ in range(2):
        for p in params:
            p.grad = torch.zeros_like(p)
        with StrictDevices():
            opt.step()
    for i, p in enumerate(params):
        on = {k: v.device.type for k, v in opt.state[p].items()
              if isinstance(v, torch.Tensor) and v.dim() > 0}
        assert on and set(on.values()) == {"meta"}, \
            f"parameter {i}'s state tensors sit on {on}, expected all on the parameter's device (meta)"


def test_step_calls_the_closure_and_returns_its_loss():
    """As torch's optimizers: step(closure) evaluates the closure (with grad enabled) first and
    returns its loss; the update then uses the gradients the closure computed."""
    from labkit.lab3.mixed_precision import MixedPrecisionAdam

    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MixedPrecisionAdam([w], lr=1e-2)

    def closure():
        opt.zero_grad()
        loss = (w.float() ** 2).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert loss is not None and float(loss.detach()) == 4.0, f"step(closure) returned {loss}, expected the closure's loss 4.0"
    assert (w < 1).all(), "step(closure) did not update w with the gradient the closure computed"
