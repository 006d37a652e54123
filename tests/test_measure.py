"""labkit.measure against cases whose bytes are known by construction: exact byte counts against
the closed form (float32: 4 bytes an element) or the same measurement on a CPU model, FLOPs
against 2mnk; and its refusals, which name the argument and what is allowed (frozen layers, meta
models, step functions that break the contract, batches that are not pairs, unknown phases)."""
import pytest
import torch
import torch.nn as nn

from labkit import measure
from labkit.measure import (CONSUMERS, by_consumer, count_flops, measure_step, peak_bytes, peak_over_calls,
                            saved_activation_bytes)
from labkit.models import GPT, GPTConfig, SyntheticData, lab_config

FP32 = 4


def _linear_step(model, optimizer, x):
    loss = model(x).square().sum()
    loss.backward()
    optimizer.step()
    return loss.detach()  # gradients kept: we want to see them after the step


@pytest.mark.parametrize("shape", [(64, 32), (17, 5)])
def test_linear_with_adam_holds_params_grads_and_two_moments_exactly(shape):
    """A Linear layer with Adam: parameters P, gradients P, states 2P + one fp32 step per tensor."""
    lin = torch.nn.Linear(*shape)
    opt = torch.optim.Adam(lin.parameters(), foreach=False)
    n = sum(p.numel() for p in lin.parameters())
    step = measure_step(lin, opt, torch.randn(8, shape[0]), step_fn=_linear_step)
    assert step.before["parameters"] == n * FP32
    assert step.before["optimizer states"] == 0
    assert step.after["parameters"] == n * FP32
    assert step.after["gradients"] == n * FP32
    # exp_avg and exp_avg_sq (2 × n fp32) plus Adam's scalar `step` tensor (fp32) per parameter tensor
    assert step.after["optimizer states"] == 2 * n * FP32 + 2 * FP32


def test_sgd_without_momentum_keeps_no_state():
    lin = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    step = measure_step(lin, opt, torch.randn(4, 32), step_fn=_linear_step)
    assert step.after["optimizer states"] == 0
    assert step.after["gradients"] == step.after["parameters"] == (32 * 32 + 32) * FP32


def test_optimizer_states_appear_at_the_first_step_and_raise_the_second_peak():
    """'Fine at step 1, out of memory at step 2': Adam's states exist only from the first update."""
    cfg = lab_config("cpu", n_layer=2, n_embd=64, n_head=2, block_size=32)
    model = GPT(cfg)
    data = SyntheticData(cfg.vocab_size, 32, 4)
    opt = torch.optim.AdamW(model.parameters())
    first = measure_step(model, opt, data.batch(0), steps=1)
    second = measure_step(model, opt, data.batch(1), steps=1)
    assert first.before["optimizer states"] == 0
    assert second.before["optimizer states"] > 0
    assert second.peak > first.peak - first.peak_of("optimizer states")
    assert second.at_peak["optimizer states"] >= second.before["optimizer states"]
    assert set(second.at_peak) == set(CONSUMERS)


def test_timeline_phases_run_forward_then_backward_then_optimizer():
    cfg = lab_config("cpu", n_layer=1, n_embd=32, n_head=2, block_size=16)
    model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = measure_step(model, opt, SyntheticData(cfg.vocab_size, 16, 2).batch(0))
    phases = [p.phase for p in step.timeline]
    collapsed = [ph for i, ph in enumerate(phases) if i == 0 or phases[i - 1] != ph]
    assert collapsed == ["forward", "backward", "optimizer"]
    assert max(p.total for p in step.timeline) <= step.peak


def test_saved_activation_bytes_counts_what_autograd_keeps():
    """y = (x @ W).relu(): autograd keeps x (for W's grad) and the relu output; W is a parameter."""
    W = torch.nn.Parameter(torch.randn(16, 8))
    x = torch.randn(4, 16)
    kept = saved_activation_bytes(lambda: (x @ W).relu())
    assert kept == x.nbytes + 4 * 8 * FP32


def test_saved_activation_bytes_skips_views_of_parameters():
    """nn.Linear saves its input and a transposed view of its weight: only the input counts."""
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    assert saved_activation_bytes(lambda: lin(x)) == x.nbytes


def test_peak_bytes_counts_what_a_computation_creates():
    """a + 1 then (a + 1) * 2: the first result (4 KiB) is alive when the second is made."""
    a = torch.zeros(1024)
    peak, out = peak_bytes(lambda: (a + 1) * 2)
    assert peak == 2 * 1024 * FP32
    assert torch.equal(out, torch.full((1024,), 2.0))


def test_count_flops_counts_a_matmul_as_2mnk():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    flops, out = count_flops(torch.mm, a, b)
    assert flops == 2 * 8 * 16 * 4
    assert out.shape == (8, 4)


def _cuda_bytes(nbytes: int) -> int:
    """What the CUDA caching allocator hands out for ``nbytes``: whole 512-byte blocks."""
    return -(-nbytes // 512) * 512


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_linear_with_adam_counts_device_blocks_and_host_step_counters_exactly(tmp_path):
    """On CUDA: parameters and gradients in 512-byte blocks, Adam's two moments likewise, and the
    two `step` counters (fp32, held on the host) counted with the optimizer states; the tracked
    device peak never exceeds what the allocator itself saw."""
    lin = torch.nn.Linear(256, 255).cuda()  # 255: the bias is not a multiple of 512 bytes
    opt = torch.optim.Adam(lin.parameters(), foreach=False)
    blocks = sum(_cuda_bytes(p.nbytes) for p in lin.parameters())
    step = measure_step(lin, opt, torch.randn(64, 256, device="cuda"), step_fn=_linear_step,
                        snapshot_path=str(tmp_path / "snap.pickle"))
    assert step.before["parameters"] == blocks, f"parameters {step.before['parameters']:,} B, expected {blocks:,}"
    assert step.after["gradients"] == blocks
    assert all(s["step"].device.type == "cpu" for s in opt.state.values()), "torch moved `step` to the GPU"
    assert step.after["optimizer states"] == 2 * blocks + 2 * FP32, \
        f"optimizer states {step.after['optimizer states']:,} B, expected 2 moments + 2 host step counters"
    assert step.host_state_bytes in (0, 2 * FP32)  # 0 if the peak came before the first update
    assert 0 < step.peak - step.host_state_bytes <= step.cuda_max_allocated, \
        f"device peak {step.peak - step.host_state_bytes:,} B > max_memory_allocated {step.cuda_max_allocated:,}"
    assert (tmp_path / "snap.pickle").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_history_is_turned_off_after_a_failing_step(tmp_path):
    """A step that raises must not leave the allocator recording every allocation."""
    lin = torch.nn.Linear(8, 8).cuda()

    def failing(model, optimizer, batch):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        measure_step(lin, None, None, step_fn=failing, snapshot_path=str(tmp_path / "s.pickle"))
    traces = lambda: sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"])  # noqa: E731
    before = traces()
    torch.empty(1 << 20, device="cuda").sum()  # an allocation and a free: traced if still recording
    assert traces() == before, "the allocator still records its history after the failed step"


def test_host_held_optimizer_state_is_counted_for_a_gpu_model():
    """Adam's `step` counters stay on the CPU when the model is on a GPU: the tracker of a CUDA
    model adds the CPU entry's optimizer-state bytes (and only those) to "optimizer states"."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    from labkit.tracker import TimelineTracker

    snap = {torch.device("cpu"): {_MemRefType.OPT: 8, _MemRefType.ACT: 1000, "Total": 1008},
            torch.device("cuda", 0): {_MemRefType.OPT: 4096, "Total": 4096}}
    assert TimelineTracker(torch.device("cuda", 0)).host_state(snap) == 8
    assert TimelineTracker(torch.device("cpu")).host_state(snap) == 0  # already in the device entry


@pytest.mark.parametrize("call, error, words", [
    (lambda lin: measure_step(lin, None, None, steps=0), ValueError, "steps must be a positive int"),
    (lambda lin: measure_step(lin, None, None, steps=1.0), ValueError, "steps must be a positive int"),
    (lambda lin: measure_step(lin, None, None, steps=True), ValueError, "steps must be a positive int"),
    (lambda lin: measure_step("model", None, None), TypeError, "model must be a torch.nn.Module"),
    (lambda lin: measure_step(torch.nn.ReLU(), None, None), ValueError, "at least one parameter"),
    (lambda lin: measure_step(lin, "adam", None), TypeError, "optimizer must be a torch.optim.Optimizer"),
    (lambda lin: measure_step(lin, None, None, step_fn=None), TypeError, "step_fn must be a callable"),
    (lambda lin: measure_step(lin, None, None, snapshot_path=3), TypeError, "snapshot_path must be"),
    (lambda lin: peak_bytes(3), TypeError, "fn must be callable"),
    (lambda lin: count_flops(None), TypeError, "fn must be callable"),
    (lambda lin: saved_activation_bytes(torch.zeros(2)), TypeError, "fn must be a callable"),
    (lambda lin: by_consumer([1, 2]), TypeError, "device_snapshot must be"),
])
def test_measure_refuses_bad_input(call, error, words):
    """Every public function of labkit.measure names the bad argument and what is allowed."""
    with pytest.raises(error, match=words):
        call(torch.nn.Linear(2, 2))


def test_peak_saved_bytes_counts_what_autograd_holds_at_its_most():
    """Two chained products of a (64, 64) fp32 tensor: autograd saves x, w-free activations and
    frees them in backward; the peak is what one forward saved (each storage once)."""
    from labkit.measure import peak_saved_bytes

    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(64, 64, requires_grad=True)

    def step():
        h = x @ w          # saves x (w is a parameter: skipped)
        y = (h * h).sum()  # saves h once (both operands are the same storage)
        y.backward()

    assert peak_saved_bytes(step) == 2 * 64 * 64 * 4
    with pytest.raises(TypeError, match="fn"):
        peak_saved_bytes(3)


def test_peak_saved_bytes_refuses_to_measure_under_other_saved_tensor_hooks():
    """Autograd calls only the innermost saved-tensor hooks: under torch.utils.checkpoint
    (non-reentrant: its forward and its recompute in backward) or hooks entered inside fn, the
    measurement would see nothing of what autograd keeps, so it raises instead of answering."""
    from torch.utils.checkpoint import checkpoint

    from labkit.measure import peak_saved_bytes

    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(64, 64, requires_grad=True)

    def under_checkpoint():
        checkpoint(lambda t: (t @ w).relu() @ w, x, use_reentrant=False).sum().backward()

    def under_own_hooks():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = ((x @ w) * (x @ w)).sum()
        y.backward()

    for fn in (under_checkpoint, under_own_hooks):
        with pytest.raises(RuntimeError, match="not measured"):
            peak_saved_bytes(fn)
    with torch.no_grad():  # nothing recorded for backward: nothing unseen
        assert peak_saved_bytes(lambda: x @ w) == 0


def test_peak_over_calls_tracks_a_module_called_many_times_exactly():
    """A Linear(64, 32) called 3 times on a (8, 64) input, the outputs kept: MemTracker alone
    refuses the second call; peak_over_calls counts the parameters once, 64·32 + 32 fp32, and
    the three (8, 32) fp32 outputs as activations; the module's class is restored after."""
    from torch.distributed._tools.mem_tracker import MemTracker

    lin, x = torch.nn.Linear(64, 32), torch.randn(8, 64)

    def three_calls():
        with torch.no_grad():
            return [lin(x) for _ in range(3)]

    with pytest.raises(NotImplementedError, match="multiple iterative calls"), MemTracker():
        three_calls()
    peak, at_peak, outputs = peak_over_calls(lin, three_calls)
    assert at_peak["parameters"] == (64 * 32 + 32) * FP32
    assert at_peak["activations"] == 3 * 8 * 32 * FP32
    assert peak == sum(at_peak.values()) and len(outputs) == 3
    assert type(lin) is torch.nn.Linear
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        peak_over_calls(three_calls, three_calls)


def _tracked_steps(tracker_class):
    """Two AdamW steps of a small GPT under ``tracker_class`` (gradients set to None in between,
    the module statistics reset before each forward); returns what the tracker recorded: the
    peak snapshot, the current one, and every module's statistics by name."""
    torch.manual_seed(0)
    cfg = lab_config("cpu", n_layer=2, n_embd=32, n_head=2, block_size=16)
    model, data = GPT(cfg), SyntheticData(cfg.vocab_size, 16, 2)
    opt = torch.optim.AdamW(model.parameters())
    tracker = tracker_class()
    tracker.track_external(model, opt)
    with tracker:
        for i in range(2):
            tracker.reset_mod_stats()
            x, y = data.batch(i)
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    modules = {s.mod_fqn: (dict(s.local_peak), s.snapshots, s.parameter_mem, s.input_mem, s.output_mem)
               for s in tracker.memory_tracking.values()}
    return tracker.get_tracker_snapshot("peak"), tracker.get_tracker_snapshot("current"), modules


def test_the_trackers_cheaper_bookkeeping_records_what_memtracker_records():
    """labkit.tracker.Tracker replaces MemTracker's per-operator peak update (cost, not result):
    the same steps under both must leave the same peak and current snapshots and the same
    statistics for every module, peaks and forward/backward snapshots included, byte for byte."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from labkit.tracker import Tracker

    theirs, ours = _tracked_steps(MemTracker), _tracked_steps(Tracker)
    assert ours[0] == theirs[0] and ours[1] == theirs[1]
    assert ours[2].keys() == theirs[2].keys() and len(ours[2]) > 10
    for name in theirs[2]:
        assert ours[2][name] == theirs[2][name], name


def test_the_tracker_keeps_no_leaf_input_alive_and_memtracker_does():
    """A module called three times on a fresh leaf that requires grad (a pipeline stage's
    received activation), forward and backward, under a tracker: PyTorch's MemTracker keeps
    every such input alive for good (its module tracker's hook, see
    ``labkit.tracker.releasing_input_hooks``), so each later peak counts them; labkit's Tracker
    keeps none once its backward has run, its hooks still fire (the module leaves the tracker's
    stack), and torch's hook registration is put back on exit, nested entries included."""
    import gc
    import weakref

    from torch.distributed._tools import mod_tracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from labkit.tracker import Tracker

    original = mod_tracker.register_multi_grad_hook

    def inputs_left(tracker_class) -> int:
        module, tracker, alive = nn.Linear(8, 8), tracker_class(), []
        with tracker:
            with tracker:  # re-entered, as measure's helpers may
                for _ in range(3):
                    tracker.reset_mod_stats()
                    x = torch.randn(4, 8).requires_grad_()
                    module(x).sum().backward()
                    assert tracker._mod_tracker.parents == {"Global"}, tracker._mod_tracker.parents
                    alive.append(weakref.ref(x))
                    del x
            assert mod_tracker.register_multi_grad_hook is not original or tracker_class is MemTracker
        assert mod_tracker.register_multi_grad_hook is original, "the hook registration was not restored"
        gc.collect()
        return sum(r() is not None for r in alive)

    assert inputs_left(MemTracker) == 3, (
        "PyTorch's MemTracker no longer keeps a leaf input alive: labkit.tracker's "
        "releasing_input_hooks may be dropped")
    assert inputs_left(Tracker) == 0, (
        "labkit.tracker.Tracker kept leaf inputs alive: has torch's register_multi_grad_hook "
        "changed (its closure's grad_fns)?")


# ---------------------------------------------------------------- models and steps the cases above do not try

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)


def _batch(device="cpu"):
    x = torch.zeros(2, 4, dtype=torch.long, device=device)
    return x, x


def _frozen_first_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    model[0].requires_grad_(False)
    return model


def _backward_step(model, optimizer, batch):
    loss = model(batch).square().mean()
    loss.backward()
    return loss.detach()


def test_a_model_with_a_frozen_layer_is_measured_and_its_gradients_are_only_the_trainable_ones():
    """Check a frozen layer (fine-tuning) is measured: MemTracker raised "cannot register a hook
    on a tensor that doesn't require gradient". Parameters 4·(72 + 36) B; gradients only the
    trainable layer's 4·36 B."""
    model = _frozen_first_layer()
    step = measure.measure_step(model, None, torch.ones(3, 8), step_fn=_backward_step)
    assert step.at_peak["parameters"] == 4 * (8 * 8 + 8 + 8 * 4 + 4)
    assert step.after["gradients"] == 4 * (8 * 4 + 4)


@pytest.mark.parametrize("run", [
    lambda m: measure.peak_bytes(lambda: _backward_step(m, None, torch.ones(3, 8)))[0],
    lambda m: measure.peak_over_calls(m, lambda: [_backward_step(m, None, torch.ones(3, 8)) for _ in range(2)])[0],
], ids=["peak_bytes", "peak_over_calls"])
def test_every_tracker_accepts_frozen_parameters(run):
    """Check peak_bytes and peak_over_calls (same MemTracker underneath) accept a frozen layer."""
    assert run(_frozen_first_layer()) > 0


def test_a_meta_model_is_refused_since_its_shared_storages_would_count_twice():
    """Check a meta-device GPT is refused by name: measured, its tied embedding counted twice
    (parameters 17,856 B vs the CPU run's 15,808 B: meta tensors have no storage to share)."""
    with pytest.raises(ValueError, match="model is on the meta device.*Measure on 'cpu'"):
        measure.measure_step(GPT(TINY).to("meta"), None, _batch("meta"))


@pytest.mark.parametrize("step_fn, error, words", [
    (lambda m, o, b: None, TypeError, r"step_fn must return the step's loss .* got NoneType"),
    (lambda m, o, b: torch.ones(3), TypeError, r"got a tensor of shape \(3,\)"),
    (lambda m, o, b: m(*b) + m(*b), ValueError, "called the model more than once .*peak_over_calls"),
])
def test_a_step_fn_that_breaks_the_contract_is_named(step_fn, error, words):
    """Check step_fn returning no loss, a loss of many elements, or calling the model twice
    (MemTracker's NotImplementedError about "iterative calls") is a message about step_fn."""
    with pytest.raises(error, match=words):
        measure.measure_step(GPT(TINY), None, _batch(), step_fn=step_fn)


@pytest.mark.parametrize("batch, words", [(None, "got NoneType"), ((1, 2, 3), "a tuple of 3")])
def test_the_default_step_names_a_batch_that_is_not_a_pair(batch, words):
    with pytest.raises(TypeError, match=rf"batch must be an \(inputs, targets\) pair .*{words}"):
        measure.measure_step(GPT(TINY), None, batch)


def test_peak_of_refuses_a_phase_that_does_not_exist():
    """Check peak_of("activations", "fwd") is refused (it returned 0: no point has that phase)."""
    step = measure.measure_step(GPT(TINY), None, _batch())
    with pytest.raises(ValueError, match=r"phase must be None or one of \('forward', 'backward', 'optimizer'\)"):
        step.peak_of("activations", "fwd")
    assert step.peak_of("activations", "forward") > 0
