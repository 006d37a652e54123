"""Graders of Lab 2's offloading exercises (labs/02_optimizer_states.ipynb): ZeRO-Offload (2.6)
and NVMe offload, ZeRO-Infinity style (2.7).

References nobody in this course wrote: ``torch.optim.Adam`` keeping its state in memory on
the parameters' device, run here in the test process, in fp32 or in mixed precision (bf16
parameters, fp32 master weights updated by Adam, rounded back to bf16 after each step — the
recipe ZeRO-Offload moves to the host); the reference gradients of an ordinary backward; the
chapter's formula K·Ψ for the bytes of state a step streams from and to the files, counted by
the file reads and writes themselves; the read-ahead window computed here from the tensor
sizes.

Tolerances: the offloaded step and the reference run the same fp32 operations on the same
values (on a CPU, the same device), so parameters agree to a few ulps of numbers ≤ ~1 (atol
1e-6, rtol 1e-5: the student may order Adam's operations differently); bf16 parameters are
their fp32 master rounded, so they may differ by one bf16 ulp where the masters straddle a
rounding boundary (rtol 2⁻⁷). Byte counts are exact integers.
"""
from __future__ import annotations

import copy

import pytest
import torch

from labkit.models import GPT, GPTConfig, SyntheticData

UPDATE_TOL = dict(atol=1e-6, rtol=1e-5)
BF16_TOL = dict(atol=1e-5, rtol=2 ** -7)  # one bf16 ulp: the master rounded either way
STEPS = 3


def tiny_gpt(seed: int = 0, dtype=torch.float32, **overrides) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg)).to(dtype)


def data():
    return SyntheticData(64, 32, 4, seed=1)


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


def assert_params_close(got_model, want_model, tol, cause):
    for (name, a), b in zip(got_model.named_parameters(), want_model.parameters()):
        assert a.dtype == b.dtype, f"{name} is {a.dtype} after the step, expected {b.dtype}: keep the parameter's dtype"
        torch.testing.assert_close(a.detach(), b.detach(), **tol, msg=lambda m, name=name: (
            f"{name} after {STEPS} steps differs from Adam with its state in memory: {m} — {cause}"))


# =================================================================== 2.6 ZeRO-Offload

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


def test_zero_offload_state_is_on_the_host():
    """Not graded (the numbers the lab shows): after a step, by location: the device holds the
    bf16 parameters (2Ψ) and no gradient; the host the master, m, v (12Ψ + 4 B per tensor's step
    counter) and the bf16 gradient buffers (2Ψ)."""
    from labkit.lab2.zero_offload import memory_by_location

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
    from labkit.lab2.zero_offload import ZeROOffload, memory_by_location

    with pytest.raises((ValueError, TypeError), match=word):
        ZeROOffload(torch.nn.Linear(2, 2), **kwargs)
    with pytest.raises(TypeError, match="model"):
        ZeROOffload([torch.zeros(2, requires_grad=True)])
    with pytest.raises(TypeError, match="offload"):
        memory_by_location(object())


# =================================================================== 2.7 NVMe offload

def run_nvme(model, directory, steps, *, start=0, read_ahead=1, on_step=None, **adam):
    from labkit.lab2.nvme_offload import NVMeAdam

    opt = NVMeAdam(model.parameters(), directory, read_ahead=read_ahead, **adam)
    batches = data()
    for i in range(start, start + steps):
        model(*batches.batch(i)).backward()
        opt.step()
        opt.zero_grad()
        if on_step is not None:
            on_step(opt)
    return opt


def k_psi(model) -> int:
    """The chapter's formula: K·Ψ, K = 8 (m, v) for fp32 parameters, 12 (+ fp32 master) for 16-bit."""
    return sum((8 if p.dtype == torch.float32 else 12) * p.numel() for p in model.parameters())


@pytest.mark.exercise("2.7", points=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nvme_adam_matches_in_memory_adam(dtype, tmp_path):
    """Check 3 steps with the state in files against ``torch.optim.Adam`` with its state in
    memory: fp32 parameters with weight decay; bf16 parameters through an fp32 master (kept in
    the files too)."""
    adam = dict(lr=1e-2, weight_decay=0.1) if dtype == torch.float32 else dict(lr=1e-2)
    model = tiny_gpt(dtype=dtype)
    want, _, _ = reference_adam(model, STEPS, **adam)
    opt = run_nvme(model, tmp_path / "state", STEPS, **adam)
    assert opt.step_count == STEPS, f"step_count is {opt.step_count} after {STEPS} steps"
    tol = UPDATE_TOL if dtype == torch.float32 else BF16_TOL
    assert_params_close(model, want, tol, "is each group's state read, updated with Adam's bias "
                        "corrections for step t, and written back (16-bit parameters: the fp32 "
                        "master updated and rounded)?")


@pytest.mark.exercise("2.7", points=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nvme_step_reads_and_writes_k_psi_bytes(dtype, tmp_path):
    """Count the bytes each step reads from and writes to the state files: K·Ψ each way
    (K = 8 for fp32 parameters: m, v; 12 for bf16 ones: master, m, v) — each group's state once."""
    model = tiny_gpt(dtype=dtype)
    want = k_psi(model)
    moved = []
    last = [None]

    def on_step(opt):
        if last[0] is None:
            last[0] = (0, 0)
        moved.append((opt.bytes_read - last[0][0], opt.bytes_written - last[0][1]))
        last[0] = (opt.bytes_read, opt.bytes_written)

    run_nvme(model, tmp_path / "state", STEPS, on_step=on_step)
    for step, (read, written) in enumerate(moved, 1):
        assert read == want, (f"step {step} read {read:,} B of state, expected K·Ψ = {want:,}: "
                              "read each group's state exactly once per step")
        assert written == want, (f"step {step} wrote {written:,} B of state, expected K·Ψ = {want:,}: "
                                 "write each group's state back exactly once per step")


def window(model, read_ahead: int) -> int:
    sizes = [(8 if p.dtype == torch.float32 else 12) * p.numel() for p in model.parameters()]
    w = min(read_ahead + 1, len(sizes))
    return max(sum(sizes[i:i + w]) for i in range(len(sizes) - w + 1))


@pytest.mark.exercise("2.7", points=2)
@pytest.mark.parametrize("read_ahead", [0, 1, 3])
def test_nvme_resident_state_stays_within_the_read_ahead_window(read_ahead, tmp_path):
    """Measure the most bytes of state buffers alive in host memory during a step (each buffer
    counted from its read until it is garbage): at most the window, K × the largest
    read_ahead + 1 consecutive tensors, never the whole state."""
    model = tiny_gpt()
    opt = run_nvme(model, tmp_path / "state", 2, read_ahead=read_ahead)
    bound = window(model, read_ahead)
    assert opt.peak_resident_bytes <= bound, (
        f"up to {opt.peak_resident_bytes:,} B of state were in memory at once with read_ahead="
        f"{read_ahead}, expected ≤ {bound:,} (the window; the whole state is {k_psi(model):,}): "
        "prefetch at most read_ahead groups beyond the current one, and drop every reference to "
        "a group's buffers once it is written")
    assert opt.resident_bytes == 0, (
        f"{opt.resident_bytes:,} B of state buffers are still alive after the step: keep no "
        "reference to them")


@pytest.mark.exercise("2.7", points=1)
@pytest.mark.parametrize("read_ahead", [1, 2])
def test_nvme_reads_ahead_of_the_update(read_ahead, tmp_path):
    """Check the order of the I/O events: the read of each group i + read_ahead is issued before
    group i is written back (the drive works while the CPU updates), and no group is read twice
    in one step."""
    model = tiny_gpt()
    opt = run_nvme(model, tmp_path / "state", 1, read_ahead=read_ahead)
    n = len(list(model.parameters()))
    where = {e: k for k, e in enumerate(opt.events)}
    reads = [e for e in opt.events if e[0] == "read"]
    assert len(reads) == len(set(reads)) == n, (
        f"{len(reads)} reads ({len(set(reads))} distinct) for {n} groups in one step: read each once")
    for i in range(n - read_ahead):
        ahead = ("read", i + read_ahead)
        assert where.get(ahead, 1 << 30) < where.get(("write", i), -1), (
            f"group {i + read_ahead} is read after group {i} is written (events: "
            f"{opt.events[:8]}...): issue the next {read_ahead} reads before updating a group")


@pytest.mark.exercise("2.7", points=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nvme_state_survives_a_restart(dtype, tmp_path):
    """Train 3 steps, drop the optimizer, build a new ``NVMeAdam`` on the same directory and a
    model holding the same (16-bit) parameters, train 2 more: the result must equal 5 steps of
    Adam in memory (the step count and, for bf16, the fp32 master come from the files)."""
    model = tiny_gpt(dtype=dtype)
    want, _, _ = reference_adam(model, 5, lr=1e-2)
    opt = run_nvme(model, tmp_path / "state", 3, lr=1e-2)
    opt.close()
    del opt
    restarted = copy.deepcopy(model)  # what a checkpoint of the model restores
    opt = run_nvme(restarted, tmp_path / "state", 2, start=3, lr=1e-2)
    assert opt.step_count == 5, (f"the resumed optimizer counts {opt.step_count} steps after 3 + 2, "
                                 "expected 5: is the step count written to the files?")
    tol = UPDATE_TOL if dtype == torch.float32 else BF16_TOL
    assert_params_close(restarted, want, tol, "after a restart the state (and the step count for "
                        "the bias corrections) must come from the files")


@pytest.mark.parametrize("call,word", [
    (lambda m, d: m.NVMeAdam([], d), "params"),
    (lambda m, d: m.NVMeAdam(torch.zeros(2), d), "params"),
    (lambda m, d: m.NVMeAdam([torch.zeros(2)], 3), "directory"),
    (lambda m, d: m.NVMeAdam([torch.zeros(2)], d, lr=-1), "lr"),
    (lambda m, d: m.NVMeAdam([torch.zeros(2)], d, betas=(1.0, 0.9)), "betas"),
    (lambda m, d: m.NVMeAdam([torch.zeros(2)], d, read_ahead=-1), "read_ahead"),
    (lambda m, d: m.NVMeAdam([torch.zeros(2)], d).prefetch(5), "i must"),
])
def test_nvme_refuses_bad_input(call, word, tmp_path):
    import labkit.lab2.nvme_offload as m

    with pytest.raises((ValueError, TypeError), match=word):
        call(m, tmp_path / "s")


def test_nvme_refuses_a_directory_of_other_parameters(tmp_path):
    from labkit.lab2.nvme_offload import NVMeAdam

    NVMeAdam([torch.zeros(3)], tmp_path)
    with pytest.raises(ValueError, match="directory"):
        NVMeAdam([torch.zeros(4)], tmp_path)


# =================================================================== lab 2's figures (not graded)

def test_plot_optim_figures_draw_and_refuse_bad_input():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit import plot_optim

    figs = [
        plot_optim.quantization_errors([64, 256], {"linear": [0.1, 0.2]}, {"linear": [1.0, 2.0]}),
        plot_optim.loss_curves({"Adam": [3.0, 2.0]}, ylim=(0, 4)),
        plot_optim.shard_deviation({2: {"your ZeRO1": [8, 8], "ZeroRedundancyOptimizer": [6, 10]}}, {2: 8}),
        plot_optim.offload_events([("grad to host", "lm_head"), ("backward starts", "h.1"),
                                   ("grad to host", "h.1.mlp.c_fc.weight")]),
        plot_optim.came_vs_adafactor({"Adam": [3.0, 2.0], "CAME": [3.0, 1.9]}, {"Adam": 80, "CAME": 40}, 10),
    ]
    assert all(isinstance(f, matplotlib.figure.Figure) for f in figs)
    for f in figs:
        plt.close(f)
    for call, word in [
        (lambda: plot_optim.quantization_errors([64], {}, {}), "errors"),
        (lambda: plot_optim.loss_curves({}), "curves"),
        (lambda: plot_optim.shard_deviation({2: {}}, {4: 8}), "world sizes"),
        (lambda: plot_optim.offload_events([]), "events"),
        (lambda: plot_optim.came_vs_adafactor({"A": [1.0]}, {"B": 1}, 10), "names"),
        (lambda: plot_optim.came_vs_adafactor({"A": [1.0]}, {"A": 1}, 0), "psi"),
    ]:
        with pytest.raises(ValueError, match=word):
            call()
