"""Graders of Lab 2, exercise 2.6 (labkit.lab2.zero_offload): ZeRO-Offload against ``torch.optim.Adam``
keeping its state in memory on the parameters' device, run here in the test process, in fp32 or
in mixed precision (bf16 parameters, fp32 master weights updated by Adam, rounded back to bf16
after each step — the recipe ZeRO-Offload moves to the host); the reference gradients of an
ordinary backward; and where each tensor's storage is (on a CPU host and device are the same
memory, so the graders check that the host buffers are the offloader's own storages, never the
device gradient, and ``labkit.harness.lab2.memory_by_location``'s bytes).

Tolerances: the offloaded step and the reference run the same fp32 operations on the same
values, so parameters agree to a few ulps of numbers ≤ ~1 (UPDATE_TOL); bf16 parameters are
their fp32 master rounded, so they may differ by one bf16 ulp (BF16_TOL). Byte counts are exact.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _lab2_helpers import (BF16_TOL, STEPS, UPDATE_TOL, assert_params_close, data, reference_adam,
                           tiny_gpt)


def run_offload(model, steps, **adam):
    from labkit.lab2.zero_offload import ZeROOffload

    off = ZeROOffload(model, **adam)
    batches = data()
    for i in range(steps):
        model(*batches.batch(i)).backward()
        off.step()
    return off


@pytest.mark.exercise("2.6", points=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_zero_offload_params_match_mixed_precision_adam(dtype):
    """Check 3 offloaded steps against Adam on the device: fp32 parameters with weight decay,
    and bf16 parameters with an fp32 master copy (mixed precision). The parameters and the
    host master weights and moments must match."""
    adam = dict(lr=1e-2, weight_decay=0.1) if dtype == torch.float32 else dict(lr=1e-2)
    model = tiny_gpt(dtype=dtype)
    want, ref_opt, ref_master = reference_adam(model, STEPS, **adam)
    off = run_offload(model, STEPS, **adam)
    tol = UPDATE_TOL if dtype == torch.float32 else BF16_TOL
    assert_params_close(model, want, tol, "is each gradient copied whole into its own host buffer, "
                        "cast to fp32 for the host Adam, and the updated master rounded back to "
                        "the parameter after the step (not before)?")
    for name, m, r, q in zip(off.names, off.master, ref_master, ref_opt.param_groups[0]["params"]):
        torch.testing.assert_close(m, r.detach().float(), **UPDATE_TOL, msg=lambda msg, name=name: (
            f"host master weight of {name}: {msg} — the host optimizer must step the fp32 master"))
        for key in ("exp_avg", "exp_avg_sq"):
            got, ref = off.optim.state[m].get(key), ref_opt.state[q][key]
            assert got is not None, f"host Adam has no {key!r} for {name}: did its step run?"
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()),
                                       msg=lambda msg, name=name, key=key: (
                f"host Adam's {key} of {name}: {msg} — is the gradient it sees the fp32 copy of "
                "this parameter's gradient of this step?"))


@pytest.mark.exercise("2.6", points=2)
def test_zero_offload_moves_gradients_to_the_host_during_backward():
    """Check, at the moment each block's backward starts (a full-backward pre-hook), that every
    parameter of the blocks after it already has its gradient in its host buffer (equal to the
    gradient of an ordinary backward) and no gradient left on the device: the copies are
    interleaved with backward, not done in step(). After backward, no ``.grad`` is left."""
    from labkit.lab2.zero_offload import ZeROOffload

    model = tiny_gpt(n_layer=4)
    ref = copy.deepcopy(model)
    x, y = data().batch(0)
    ref(x, y).backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    off = ZeROOffload(model, lr=1e-3)
    problems = []

    def check(k):
        def hook(module, grad_output):
            off.events.append(("backward starts", f"h.{k}"))
            for j in range(k + 1, len(model.h)):
                for name, p in model.h[j].named_parameters(prefix=f"h.{j}"):
                    i = off.names.index(name)
                    if p.grad is not None:
                        problems.append(f"{name}: .grad still on the device when h.{k}'s backward "
                                        "starts: release it in the hook once it is copied")
                    elif off.copied[i] is not None:
                        off.copied[i].synchronize()
                    if not torch.equal(off.host_grads[i].float(), want[name].to(off.host_grads[i].dtype).float()):
                        problems.append(f"{name}: its host buffer does not hold its gradient when "
                                        f"h.{k}'s backward starts: copy it in the hook, as backward "
                                        "makes it, not later in step()")
        return hook

    for k, block in enumerate(model.h):
        block.register_full_backward_pre_hook(check(k))
    model(x, y).backward()
    assert not problems, f"{len(problems)} problem(s), first: {problems[0]}"
    left = [n for n, p in model.named_parameters() if p.grad is not None]
    assert not left, f"after backward, {left} still hold a device .grad: release every gradient in the hook"
    copies = [e for e in off.events if e[0] == "grad to host"]
    assert len(copies) == len(off.params), (
        f"{len(copies)} gradient copies in one backward, expected one per parameter ({len(off.params)})")
    first_block = off.events.index(("backward starts", "h.0"))
    early = sum(1 for e in off.events[:first_block] if e[0] == "grad to host")
    assert early > 0, "no gradient reached the host before the first block's backward: not interleaved"
    off.step()
    assert not off.arrived, f"arrived still holds {sorted(off.arrived)} after step(): reset it for the next step"


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 8)


@pytest.mark.exercise("2.6", points=1)
def test_zero_offload_skips_parameters_without_a_gradient():
    """Step 1 uses both layers, step 2 only the first: like ``torch.optim.Adam`` (which skips a
    parameter whose ``.grad`` is None), the second layer must not move in step 2 — a stale host
    gradient from step 1 must not be applied again."""
    from labkit.lab2.zero_offload import ZeROOffload

    torch.manual_seed(0)
    model = TwoLayers()
    ref = copy.deepcopy(model)
    xs = [torch.randn(4, 8) for _ in range(2)]
    off = ZeROOffload(model, lr=1e-2)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step, x in enumerate(xs):
        for net, stepper in ((model, off), (ref, opt)):
            h = net.first(x)
            out = net.second(h) if step == 0 else h
            out.square().mean().backward()
            stepper.step()
            stepper.zero_grad()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), **UPDATE_TOL, msg=lambda m, name=name: (
            f"{name} after a step in which {'it had no gradient' if 'second' in name else 'it had one'}: "
            f"{m} — update only the parameters whose gradient arrived since the last step"))
    for name, master, b in zip(off.names, off.master, ref.parameters()):
        torch.testing.assert_close(master, b.detach(), **UPDATE_TOL, msg=lambda m, name=name: (
            f"host master weight of {name}: {m} — the host optimizer must not step a parameter "
            "whose gradient did not arrive this step (give it no .grad)"))


@pytest.mark.exercise("2.6", points=1)
def test_zero_offload_keeps_no_fp32_gradient_after_the_step():
    """bf16 model, two steps: after each, the host holds exactly its bf16 gradient buffers
    (2 B per parameter) as gradients, every fp32 gradient the host step used is released
    (4 B per parameter otherwise, held until the next step), and the device holds none. Exact
    bytes (``memory_by_location``, each storage once); and the steps whose bytes were counted
    are Adam's (BF16_TOL), so releasing gradients without stepping earns nothing."""
    from labkit.harness.lab2 import memory_by_location

    model = tiny_gpt(dtype=torch.bfloat16)
    want, _, _ = reference_adam(model, 2)
    off = run_offload(model, 2)
    psi = sum(p.numel() for p in off.params)
    got = memory_by_location(off)
    assert got["host"]["gradients"] == 2 * psi, (
        f"host gradients after the step: {got['host']['gradients']:,} B, expected the bf16 "
        f"buffers' 2·Ψ = {2 * psi:,} B"
        + (": the fp32 gradients given to the master weights are still alive (set them to None "
           "once the host step has used them)" if got["host"]["gradients"] == 6 * psi else ""))
    assert got["device"]["gradients"] == 0, (
        f"device gradients after the step: {got['device']['gradients']:,} B, expected 0")
    assert_params_close(model, want, BF16_TOL, "the run whose bytes were measured must train as "
                        "Adam does: is the host optimizer stepped on this step's gradients and the "
                        "master rounded back to the parameter?", steps=2)


def test_zero_offload_state_is_on_the_host():
    """Not graded (the numbers the lab shows): after a step, by location: the device holds the
    bf16 parameters (2Ψ) and no gradient; the host the master, m, v (12Ψ + 4 B per tensor's step
    counter) and the bf16 gradient buffers (2Ψ)."""
    from labkit.harness.lab2 import memory_by_location

    model = tiny_gpt(dtype=torch.bfloat16)
    off = run_offload(model, 1)
    psi = sum(p.numel() for p in off.params)
    got = memory_by_location(off)
    assert got["device"] == {"parameters": 2 * psi, "gradients": 0, "optimizer states": 0}
    assert got["host"] == {"parameters": 0, "gradients": 2 * psi,
                           "optimizer states": 12 * psi + 4 * len(off.params)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_zero_offload_lowers_the_device_peak_on_cuda():
    """On a GPU: the device's peak (``torch.cuda.max_memory_allocated``) over two bf16 steps of a
    fresh copy of the model with on-device mixed-precision Adam, minus the same with
    ZeRO-Offload, is at least Adam's m and v (8Ψ; the master and the fp32 gradient copies come
    on top). Each run allocates its own copy, master and state after the baseline is taken."""
    from labkit.lab2.zero_offload import ZeROOffload

    model = tiny_gpt(dtype=torch.bfloat16, n_layer=4, n_embd=256).cuda()
    psi = sum(p.numel() for p in model.parameters())
    x, y = (t.cuda() for t in data().batch(0))

    def device_run():
        net = copy.deepcopy(model)
        master = [p.detach().float() for p in net.parameters()]
        opt = torch.optim.Adam(master, lr=1e-3)
        for _ in range(2):
            net(x, y).backward()
            for m, p in zip(master, net.parameters()):
                m.grad = p.grad.float()
                p.grad = None
            opt.step()
            with torch.no_grad():
                for m, p in zip(master, net.parameters()):
                    p.copy_(m)

    def offload_run():
        net = copy.deepcopy(model)
        off = ZeROOffload(net, lr=1e-3)
        for _ in range(2):
            net(x, y).backward()
            off.step()
        torch.cuda.synchronize()
        off.remove()

    def peak(run):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    device_peak, offload_peak = peak(device_run), peak(offload_run)
    assert device_peak - offload_peak >= 8 * psi, (
        f"device peak {device_peak:,} B with on-device Adam, {offload_peak:,} B offloaded: the "
        f"drop is less than 8Ψ = {8 * psi:,}: are the master, m and v on the host?")


@pytest.mark.parametrize("kwargs,word", [
    (dict(lr=-1), "lr"), (dict(betas=(0.9,)), "betas"), (dict(eps="x"), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
])
def test_zero_offload_refuses_bad_input(kwargs, word):
    from labkit.harness.lab2 import memory_by_location
    from labkit.lab2.zero_offload import ZeROOffload

    with pytest.raises((ValueError, TypeError), match=word):
        ZeROOffload(torch.nn.Linear(2, 2), **kwargs)
    with pytest.raises(TypeError, match="model"):
        ZeROOffload([torch.zeros(2, requires_grad=True)])
    with pytest.raises(TypeError, match="offload"):
        memory_by_location(object())


@pytest.mark.exercise("2.6", points=1)
def test_zero_offload_host_buffers_are_its_own_storage():
    """On a CPU host and device are the same memory, so "the gradient reached the host" is
    checked by storage, which a shortcut cannot fake: a hook registered before the offloader's
    records each device gradient's storage; after backward each parameter's host buffer must
    still be the buffer allocated at construction (same storage, filled in place, equal to the
    gradient), share no storage with any device gradient, and the device gradients must be
    garbage. ``memory_by_location`` then reports no gradient bytes on the device."""
    import gc
    import weakref

    from labkit.harness.lab2 import memory_by_location
    from labkit.lab2.zero_offload import ZeROOffload

    model = tiny_gpt(dtype=torch.bfloat16)
    seen = {}

    def record(p):
        seen[id(p)] = (p.grad.untyped_storage().data_ptr(), weakref.ref(p.grad), p.grad.clone())

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(record)
    off = ZeROOffload(model, lr=1e-3)
    allocated = [g.untyped_storage().data_ptr() for g in off.host_grads]
    x, y = data().batch(0)
    model(x, y).backward()
    gc.collect()
    device_ptrs = {ptr for ptr, _, _ in seen.values()}
    for i, (name, p) in enumerate(zip(off.names, off.params)):
        ptr, alive, value = seen[id(p)]
        buf = off.host_grads[i]
        assert buf.untyped_storage().data_ptr() == allocated[i] and buf.dtype == p.dtype, (
            f"{name}: host_grads[{i}] is no longer the host buffer allocated at construction "
            "(on a GPU a replaced buffer is the device gradient itself: nothing left the device): "
            "copy the gradient into it in place")
        assert buf.untyped_storage().data_ptr() not in device_ptrs, (
            f"{name}: the host buffer shares storage with a device gradient")
        torch.testing.assert_close(buf, value, rtol=0, atol=0, msg=lambda m, name=name: (
            f"{name}: the host buffer does not hold this step's gradient: {m}"))
        assert alive() is None, (f"{name}: the device gradient is still alive after backward: "
                                 "release it (param.grad = None) once it is copied")
    where = memory_by_location(off)
    assert where["device"]["gradients"] == 0, f"gradient bytes on the device: {where['device']}"


@pytest.mark.exercise("2.6", points=1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_zero_offload_adds_up_several_backwards_before_a_step(dtype):
    """Check two backwards before each of 2 steps (the second through part of the model only),
    on a toy whose loss is linear in its parameters (tests/_conformance_helpers.py: each backward
    leaves exactly the chosen gradient): the parameters equal Adam's on the summed gradient —
    on the device for fp32, through an fp32 master for bf16 — as ``.grad`` would add them up.
    Tolerance: UPDATE_TOL (fp32), BF16_TOL (the master rounded either way)."""
    from _conformance_helpers import ALL, Toy, assert_histories_close, gradients, reference_run, run
    from labkit.lab2.zero_offload import ZeROOffload

    G = gradients([[[set(ALL), {"h.0.weight", "head"}]]] * 2, dtype)
    model = Toy(dtype)
    want = reference_run(model, lambda ps: torch.optim.Adam(ps, lr=0.05), G, 1,
                         master=dtype != torch.float32)
    got = run(model, ZeROOffload(model, lr=0.05), G)
    assert_histories_close(got, want, f"two backwards per step, {dtype}: is a gradient that "
                           "arrives again before step() added to the one already on the host?",
                           **(UPDATE_TOL if dtype == torch.float32 else BF16_TOL))
