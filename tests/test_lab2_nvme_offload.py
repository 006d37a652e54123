"""Graders of Lab 2, exercise 2.7 (labkit.lab2.nvme_offload): NVMe offload against ``torch.optim.Adam``
keeping its state in memory (fp32, or bf16 through an fp32 master), the chapter's formula K·Ψ for
the bytes a step streams from and to the files (counted by the reads and writes themselves), and
the read-ahead window computed here from the tensor sizes.

Tolerances: UPDATE_TOL for fp32 (same operations, another order), BF16_TOL (one bf16 ulp of a
rounded master) for bf16; byte counts are exact.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _given import held_bytes
from _lab2_helpers import (BF16_TOL, STEPS, UPDATE_TOL, assert_params_close, data, late_gradient_run,
                           reference_adam, tiny_gpt)


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
    (K = 8 for fp32 parameters: m, v; 12 for bf16 ones: master, m, v) — each group's state once;
    and the steps whose bytes were counted are Adam's (moving the bytes without the update earns
    nothing)."""
    model = tiny_gpt(dtype=dtype)
    want = k_psi(model)
    adam, _, _ = reference_adam(model, STEPS)
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
    assert_params_close(model, adam, UPDATE_TOL if dtype == torch.float32 else BF16_TOL,
                        MEASURED_CAUSE)


MEASURED_CAUSE = ("the steps whose I/O was measured must be Adam's steps: is each group's state "
                  "read, updated with Adam's bias corrections and written back, and the parameter "
                  "moved?")


def window(model, read_ahead: int) -> int:
    sizes = [(8 if p.dtype == torch.float32 else 12) * p.numel() for p in model.parameters()]
    w = min(read_ahead + 1, len(sizes))
    return max(sum(sizes[i:i + w]) for i in range(len(sizes) - w + 1))


@pytest.mark.exercise("2.7", points=2)
@pytest.mark.parametrize("read_ahead", [0, 1, 3])
def test_nvme_resident_state_stays_within_the_read_ahead_window(read_ahead, tmp_path):
    """Measure the most bytes of state buffers alive in host memory during a step (each buffer
    counted from its read until it is garbage): at most the window, K × the largest
    read_ahead + 1 consecutive tensors, never the whole state; and the measured steps are Adam's."""
    model = tiny_gpt()
    adam, _, _ = reference_adam(model, 2)
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
    params = list(model.parameters())
    held = held_bytes(opt, skip=[*params, *(p.grad for p in params)])
    assert held == 0, (  # what the counters above do not see: tensors kept in any attribute
        f"after the step NVMeAdam holds {held:,} B of tensors besides the parameters and their "
        "gradients (in its attributes): the state lives in the files between steps")
    assert_params_close(model, adam, UPDATE_TOL, MEASURED_CAUSE, steps=2)


@pytest.mark.exercise("2.7", points=1)
@pytest.mark.parametrize("read_ahead", [1, 2])
def test_nvme_reads_ahead_of_the_update(read_ahead, tmp_path):
    """Check the order of the I/O events: the read of each group i + read_ahead is issued before
    group i is written back (the drive works while the CPU updates), and no group is read twice
    in one step; and that the step whose I/O was traced is Adam's."""
    model = tiny_gpt()
    adam, _, _ = reference_adam(model, 1)
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
    assert_params_close(model, adam, UPDATE_TOL, MEASURED_CAUSE, steps=1)


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
    (lambda m, d: m.NVMeAdam([torch.zeros(2)], __file__), "directory"),  # a file, not a directory
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
    for other in ("{not json", "[1, 2]", '{"epoch": 3}'):  # another tool's step.json, or a damaged one
        (tmp_path / "step.json").write_text(other)  # was a JSONDecodeError, an AttributeError, a KeyError
        with pytest.raises(ValueError, match="holds a step.json that is not NVMeAdam's"):
            NVMeAdam([torch.zeros(3)], tmp_path)


@pytest.mark.exercise("2.7", points=1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nvme_keeps_torch_adams_step_per_parameter(dtype, tmp_path):
    """A 4×6 weight gets a gradient at every one of 3 steps, a 6-vector only from step 2 on: as
    ``torch.optim.Adam`` does, the vector is skipped at step 1 and its own step count starts at
    its first gradient, so its bias corrections are those of t = 1, 2 (not 2, 3). Reference:
    Adam in memory (through an fp32 master for bf16), lr 0.1. Tolerance: UPDATE_TOL / BF16_TOL."""
    from labkit.lab2.nvme_offload import NVMeAdam

    def make_ref(params):
        if dtype == torch.float32:
            return torch.optim.Adam(params, lr=0.1)
        return MasterAdam(params, lr=0.1)

    opt, a, b, got = late_gradient_run(lambda ps: NVMeAdam(ps, tmp_path / "s", lr=0.1), dtype=dtype)
    _, _, _, want = late_gradient_run(make_ref, dtype=dtype)
    tol = UPDATE_TOL if dtype == torch.float32 else BF16_TOL
    for step, ((ga, gb), (wa, wb)) in enumerate(zip(got, want), 1):
        for name, x, y in (("weight (a gradient every step)", ga, wa),
                           ("vector (first gradient at step 2)", gb, wb)):
            torch.testing.assert_close(x, y, **tol, msg=lambda m, name=name, step=step: (
                f"{name} after step {step} vs torch.optim.Adam: {m}"
                + (" — the vector's bias corrections must count its own steps (it was skipped "
                   "at step 1), not the optimizer's" if "vector" in name and step >= 2 else "")))
    assert opt.steps == [3, 2], (f"per-group step counts {opt.steps}, expected [3, 2]: a group "
                                 "without a gradient is skipped and its count does not advance")
    # A 4th call with no gradient at all: nothing moves, no group's count advances, but
    # step_count counts the calls (the contract), so it is 4.
    before = (a.detach().clone(), b.detach().clone())
    opt.step()
    assert opt.step_count == 4 and opt.steps == [3, 2], (
        f"after a 4th step() with no gradient anywhere: step_count {opt.step_count}, per-group "
        f"counts {opt.steps}; expected 4 and [3, 2]: step_count counts every call of step(), "
        "each group's count only its steps with a gradient")
    assert torch.equal(a, before[0]) and torch.equal(b, before[1]), (
        "a step() with no gradient anywhere moved a parameter: skip every group without one")


class MasterAdam:
    """``torch.optim.Adam`` over fp32 masters of 16-bit parameters (gradients cast to fp32, the
    master rounded back): mixed-precision Adam, the reference for 16-bit parameters."""

    def __init__(self, params, **adam):
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.pairs = []
        spec = []
        for g in groups:
            masters = []
            for p in g["params"]:
                m = p.detach().float().clone()
                self.pairs.append((p, m))
                masters.append(m)
            spec.append({**g, "params": masters})
        self.opt = torch.optim.Adam(spec, **adam)

    @torch.no_grad()
    def step(self):
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        for p, m in self.pairs:
            p.copy_(m.to(p.dtype))


@pytest.mark.exercise("2.7", points=1)
def test_nvme_bf16_weight_decay_uses_the_fp32_master(tmp_path):
    """bf16 parameters with L2 weight decay 0.5 against mixed-precision Adam (decay added to the
    fp32 gradient from the fp32 master). The decay term must come from the master: the bf16
    weight differs from it by up to half a bf16 ulp, which λ·(θ − bf16(θ)) turns into a
    different gradient, and Adam's normalization into a different step on small-gradient
    elements. Tolerance: BF16_TOL on the weights, 1e-6 relative on the masters in the file."""
    from labkit.lab2.nvme_offload import NVMeAdam

    g = torch.Generator().manual_seed(6)
    w0 = (torch.randn(32, 32, generator=g) * 0.5).to(torch.bfloat16)
    grads = [torch.randn(32, 32, generator=g) * 1e-3 for _ in range(4)]
    runs = []
    for make in (lambda ps: NVMeAdam(ps, tmp_path / "s", lr=1e-3, weight_decay=0.5),
                 lambda ps: MasterAdam(ps, lr=1e-3, weight_decay=0.5)):
        w = torch.nn.Parameter(w0.clone())
        opt = make([w])
        for gr in grads:
            w.grad = gr.to(torch.bfloat16)
            opt.step()
            w.grad = None
        runs.append((w.detach(), opt))
    (got, nvme), (want, ref) = runs
    master = nvme.prefetch(0).result()["master"]
    torch.testing.assert_close(master, ref.pairs[0][1], rtol=1e-6, atol=1e-9, msg=lambda m: (
        f"fp32 master after 4 steps with weight decay 0.5: {m} — take the decay term from the "
        "fp32 master, not from the bf16 parameter"))
    torch.testing.assert_close(got, want, **BF16_TOL)


@pytest.mark.exercise("2.7", points=1)
def test_nvme_applies_each_groups_options(tmp_path):
    """Two parameter groups (lr 1e-2, betas (0.9, 0.999), no decay; lr 5e-2, betas (0.5, 0.9),
    eps 1e-3, weight decay 0.1) against ``torch.optim.Adam`` with the same groups, 3 steps.
    Tolerance: UPDATE_TOL."""
    from labkit.lab2.nvme_offload import NVMeAdam

    groups = [dict(lr=1e-2), dict(lr=5e-2, betas=(0.5, 0.9), eps=1e-3, weight_decay=0.1)]
    _, _, _, got = late_gradient_run(lambda ps: NVMeAdam(ps, tmp_path / "s"), groups=groups)
    _, _, _, want = late_gradient_run(lambda ps: torch.optim.Adam(ps), groups=groups)
    for step, ((ga, gb), (wa, wb)) in enumerate(zip(got, want), 1):
        for k, (x, y) in enumerate(((ga, wa), (gb, wb))):
            torch.testing.assert_close(x, y, **UPDATE_TOL, msg=lambda m, k=k, step=step: (
                f"group {k} ({groups[k]}) after step {step} vs torch.optim.Adam: {m} — use the "
                "group's own options (self.options[i])"))
