"""Graders of lab 5's exercise 5.4 (labs/05_activations.ipynb): selective recomputation.

References: the operators' own FLOPs (``FlopCounterMode``'s registry) and output bytes recorded
by a dispatch mode, PyTorch's per-block checkpointing and the plain model for gradients.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, set_checkpoint_early_stop

from labkit.measure import count_flops
from _lab5_helpers import one_thread  # noqa: F401  (autouse fixture)
from _lab5_helpers import GRAD_TOL, B, T, C, small_gpt, _MatmulOutputBytes, blocks_input_grad, blocks_memory, fully_checkpointed, model_grads, data, aten


# ------------------------------------------------------------------ 5.4 selective

class _OpRecorder(TorchDispatchMode):
    """Every operator call of a forward: (op, args, kwargs, output)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out


def step_flops(model, idx, targets):
    """FLOPs of one forward + backward of the model (early stop off); its gradients stay."""
    with set_checkpoint_early_stop(False):
        return count_flops(lambda: model(idx, targets).backward())[0]


def check_measured(model, reference, what):
    """A measurement counts only for the right result: the gradients the counted step left on
    ``model`` (apply_selective_checkpointing keeps the parameters in order) must be those
    ``reference``, the plain model, got from the same step (GRAD_TOL)."""
    for (name, want), p in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, want.grad, **GRAD_TOL, msg=lambda m, name=name: (
            f"{what}: {name}.grad of the step whose FLOPs were counted differs from the plain "
            f"model's: {m} — does each block run on its own input, its output flowing on?"))


def check_measured_memory(input_grad, reference, what):
    """The measured step's input gradient (blocks_memory) must be the plain blocks' (GRAD_TOL)."""
    torch.testing.assert_close(input_grad, blocks_input_grad(reference), **GRAD_TOL, msg=lambda m: (
        f"{what}: the input gradient of the step whose bytes were measured differs from the plain "
        f"blocks': {m} — does each block run on its own input, its output flowing on?"))


def _block_ops(n_head=2, attention="naive"):
    with _OpRecorder() as recorder:
        small_gpt(1, n_head=n_head, attention=attention).h[0](torch.randn(B, T, C))
    return recorder.calls


def _plain_flops_and_bytes(func, args, kwargs, out):
    """The reference numbers: FlopCounterMode on the call run again, and the output's bytes."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        func(*args, **kwargs)  # no_grad: an in-place op on a leaf may run again
    outs = out if isinstance(out, (tuple, list)) else (out,)
    nbytes = sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
    return counter.get_total_flops(), nbytes


@pytest.mark.exercise("5.4", points=2)
@pytest.mark.parametrize("threshold", [0, 20, 64, 1e9])
def test_policy_keeps_what_costs_more_flops_per_byte_than_the_threshold(threshold):
    """Check the policy on every operator of a block against FlopCounterMode and the output's bytes."""
    from types import SimpleNamespace

    from labkit.lab5.selective_checkpoint import FlopsPerBytePolicy

    policy = FlopsPerBytePolicy(threshold)
    for func, args, kwargs, out in _block_ops():
        flops, nbytes = _plain_flops_and_bytes(func, args, kwargs, out)
        want = (CheckpointPolicy.MUST_SAVE if nbytes > 0 and flops > threshold * nbytes
                else CheckpointPolicy.PREFER_RECOMPUTE)
        for recompute in (False, True):
            got = policy(SimpleNamespace(op_output=out, is_recompute=recompute), func, *args,
                         **kwargs)
            assert got == want, (
                f"threshold {threshold:g} FLOPs/B, {func} (recompute={recompute}): policy says "
                f"{got}, expected {want}: it costs {flops:,} FLOPs to recompute and keeps "
                f"{nbytes:,} B ({flops / max(nbytes, 1):.1f} FLOPs/B). Compare FLOPs with "
                f"threshold × bytes; FLOPs as FlopCounterMode counts them (0 for element-wise)")


@pytest.mark.exercise("5.4", points=1)
@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_policy_decides_at_each_operators_own_flops_per_byte(attention):
    """Check the boundary: at a threshold equal to an operator's FLOPs per byte (when exact) the
    output is recomputed, just below it kept; on a block with 4 heads (d = 16 ≠ T = 32) and with
    PyTorch's fused attention (two outputs: O and the log-sum-exp)."""
    from types import SimpleNamespace

    from labkit.lab5.selective_checkpoint import FlopsPerBytePolicy

    for func, args, kwargs, out in _block_ops(n_head=4, attention=attention):
        flops, nbytes = _plain_flops_and_bytes(func, args, kwargs, out)
        if not flops or not nbytes:
            continue
        at = flops / nbytes
        thresholds = [math.nextafter(at, 0), math.nextafter(at, math.inf)]
        if at * nbytes == flops:
            thresholds.append(at)
        for threshold in thresholds:
            want = (CheckpointPolicy.MUST_SAVE if flops > threshold * nbytes
                    else CheckpointPolicy.PREFER_RECOMPUTE)
            got = FlopsPerBytePolicy(threshold)(SimpleNamespace(op_output=out, is_recompute=False),
                                                func, *args, **kwargs)
            assert got == want, (
                f"{attention} attention, {func}: {flops:,} FLOPs over {nbytes:,} B of output (all "
                f"its outputs) = {at:.4f} FLOPs/B; at threshold {threshold!r} the policy says "
                f"{got}, expected {want}")


@pytest.mark.exercise("5.4", points=1)
@pytest.mark.parametrize("op", ["_scaled_dot_product_efficient_attention",
                                "_scaled_dot_product_flash_attention"])
def test_policy_counts_every_output_of_a_fused_attention(op):
    """Check the policy on CUDA's fused attention operators (several outputs: O, the log-sum-exp,
    RNG state…), run here on the meta device: the bytes kept are all the outputs' bytes, so the
    decision flips exactly at FLOPs / (all outputs' bytes). On a CPU the fused kernel has no FLOP
    formula, so only this case shows it."""
    from types import SimpleNamespace

    from torch.utils.flop_counter import flop_registry

    from labkit.lab5.selective_checkpoint import FlopsPerBytePolicy

    func = getattr(aten, op).default
    q, k, v = (torch.empty(2, 4, 32, 16, device="meta") for _ in range(3))
    args = (q, k, v, None, True) if "efficient" in op else (q, k, v)
    out = func(*args)
    flops = flop_registry[func.overloadpacket](*args, out_val=out)
    nbytes = sum(t.numel() * t.element_size() for t in out if isinstance(t, torch.Tensor))
    at = flops / nbytes
    for threshold, want in ((math.nextafter(at, 0), CheckpointPolicy.MUST_SAVE),
                            (math.nextafter(at, math.inf), CheckpointPolicy.PREFER_RECOMPUTE)):
        got = FlopsPerBytePolicy(threshold)(SimpleNamespace(op_output=out, is_recompute=False),
                                            func, *args)
        assert got == want, (
            f"{op}: {flops:,} FLOPs over {nbytes:,} B of outputs ({len(out)} outputs, "
            f"{at:.4f} FLOPs/B); at threshold {threshold!r} the policy says {got}, expected {want}")


@pytest.mark.exercise("5.4", points=1)
def test_recompute_flops_counts_convolutions_as_flopcountermode():
    """Check recompute_flops on a convolution and a transposed one, which the contract lists
    with the matrix products: FlopCounterMode's formula for them reads the output's shape, so
    the count must hand the formula the operator's output (``out_val``), as FlopCounterMode
    does. Exact integers: the reference is FlopCounterMode running the same call."""
    from labkit.lab5.selective_checkpoint import recompute_flops

    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 9)
    for conv in (torch.nn.Conv2d(3, 4, 3, stride=2, padding=1),
                 torch.nn.ConvTranspose2d(3, 4, 3, stride=2)):
        with torch.no_grad(), _OpRecorder() as recorder:
            conv(x)
        counted = 0
        for func, args, kwargs, out in recorder.calls:
            want, _ = _plain_flops_and_bytes(func, args, kwargs, out)
            got = recompute_flops(func, args, kwargs, out)
            assert got == want, (
                f"{type(conv).__name__}, {func}: recompute_flops gives {got!r}, FlopCounterMode "
                f"counts {want:,}: call the operator's FLOP formula (flop_registry, by overload "
                f"packet) with its output too (out_val=out), as FlopCounterMode does")
            counted += want
        assert counted > 0, (f"{type(conv).__name__}: FlopCounterMode counted no FLOPs: did "
                             f"FlopCounterMode stop counting convolutions?")


@pytest.mark.exercise("5.4", points=1)
def test_a_threshold_between_the_attention_matmuls_keeps_softmax_v_only():
    """Check the measured trade with 4 heads (d = 16, T = 32): q·kᵀ does 2·d/4 = 8 FLOPs per byte
    of its (T × T) output, softmax·v 2·T/4 = 16 per byte of its (T × d) output; at 12 FLOPs/B
    only q·kᵀ is recomputed."""
    from labkit.harness.lab5 import apply_selective_checkpointing
    from labkit.lab5.selective_checkpoint import FlopsPerBytePolicy

    n_layers, threshold = 2, 12
    idx, targets = data()
    low_flops = low_bytes = 0
    for func, args, kwargs, out in _block_ops(n_head=4):
        if func == aten.bmm.default:
            flops, nbytes = _plain_flops_and_bytes(func, args, kwargs, out)
            if flops <= threshold * nbytes:
                low_flops, low_bytes = low_flops + flops, low_bytes + nbytes
    assert low_flops > 0, "the grader's block has no matmul under 12 FLOPs/B: its shape changed?"

    reference = small_gpt(n_layers, n_head=4)
    plain = step_flops(reference, idx, targets)
    model = apply_selective_checkpointing(small_gpt(n_layers, n_head=4), FlopsPerBytePolicy(threshold))
    got = step_flops(model, idx, targets)
    assert got - plain == n_layers * low_flops, (
        f"threshold {threshold}, head size 16, T = 32: {got - plain:,} extra FLOPs, expected "
        f"{n_layers * low_flops:,} (q·kᵀ of {n_layers} blocks recomputed, softmax·v kept): FLOPs "
        f"per byte of each matmul's own output, 2·(inner size)/4")
    check_measured(model, reference, f"threshold {threshold}, 4 heads")
    grads = []
    held_default, _ = blocks_memory(apply_selective_checkpointing(small_gpt(n_layers, n_head=4)), grads)
    held, _ = blocks_memory(model, grads)
    assert held_default - held == n_layers * low_bytes, (
        f"threshold {threshold}, 4 heads: holds {held_default - held:,} B less than threshold 0 "
        f"after forward, expected {n_layers * low_bytes:,} (q·kᵀ's outputs)")
    for grad in grads:
        check_measured_memory(grad, reference, f"threshold {threshold}, 4 heads")


@pytest.mark.exercise("5.4", points=2)
def test_a_threshold_above_attention_recomputes_exactly_its_matmuls():
    """Check the measured trade at 20 FLOPs/B: extra FLOPs = the attention bmm's, bytes drop by their outputs.

    On the test block (2 heads: head size d = 32, T = 32) q·kᵀ does 2·d/4 = 16 FLOPs per byte of
    its (T × T) output and softmax·v 2·T/4 = 16 per byte of its (T × d) output — equal only
    because d = T here — and the weight GEMMs 32 and 128: at 20 both attention matmuls are
    recomputed and nothing else.
    """
    from labkit.harness.lab5 import apply_selective_checkpointing
    from labkit.lab5.selective_checkpoint import FlopsPerBytePolicy

    n_layers = 3
    idx, targets = data()
    bmm_flops = bmm_bytes = 0
    for func, args, kwargs, out in _block_ops():
        if func == aten.bmm.default:
            flops, nbytes = _plain_flops_and_bytes(func, args, kwargs, out)
            bmm_flops, bmm_bytes = bmm_flops + flops, bmm_bytes + nbytes

    reference = small_gpt(n_layers)
    plain = step_flops(reference, idx, targets)
    model = apply_selective_checkpointing(small_gpt(n_layers), FlopsPerBytePolicy(20))
    got = step_flops(model, idx, targets)
    assert got - plain == n_layers * bmm_flops, (
        f"threshold 20: {got - plain:,} extra FLOPs, expected {n_layers * bmm_flops:,} (the two "
        f"attention matmuls of {n_layers} blocks, 16 FLOPs/B): is the policy passed on to the "
        f"blocks, and are FLOPs compared with threshold × bytes?")
    check_measured(model, reference, "threshold 20")
    grads = []
    held_default, _ = blocks_memory(apply_selective_checkpointing(small_gpt(n_layers)), grads)
    held_20, _ = blocks_memory(apply_selective_checkpointing(small_gpt(n_layers),
                                                             FlopsPerBytePolicy(20)), grads)
    assert held_default - held_20 == n_layers * bmm_bytes, (
        f"threshold 20 holds {held_default - held_20:,} B less than threshold 0 after forward, "
        f"expected {n_layers * bmm_bytes:,} (the attention matmuls' outputs)")
    for grad in grads:
        check_measured_memory(grad, reference, "threshold 20")


@pytest.mark.exercise("5.4", points=2)
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_selective_checkpointing_gradients_equal_the_plain_model(dropout):
    """Check gradients equal the plain model's with every block selectively checkpointed; with
    dropout 0.2 in training mode (same seed) the recompute must draw forward's masks."""
    from labkit.harness.lab5 import apply_selective_checkpointing

    idx, targets = data()
    reference = small_gpt(3, dropout=dropout)
    torch.manual_seed(11)
    model_grads(reference, idx, targets)
    model = small_gpt(3, dropout=dropout)
    names = {id(p): n for n, p in model.named_parameters()}
    apply_selective_checkpointing(model)
    torch.manual_seed(11)
    model_grads(model, idx, targets)
    expected = {n: p.grad for n, p in reference.named_parameters()}
    hint = (" — does the recompute draw new dropout masks (the RNG state forward used must be "
            "restored)?" if dropout else "")
    for p in model.parameters():
        name = names[id(p)]
        torch.testing.assert_close(p.grad, expected[name], **GRAD_TOL,
                                   msg=lambda m: f"{name}.grad under selective checkpointing, "
                                                 f"dropout {dropout}: {m}{hint}")


@pytest.mark.exercise("5.4", points=2)
def test_selective_checkpointing_recomputes_no_matmul():
    """Check FlopCounterMode: selective = no checkpointing, exactly; full adds a forward."""
    from labkit.harness.lab5 import apply_selective_checkpointing

    idx, targets = data()

    reference = small_gpt(3)
    plain = step_flops(reference, idx, targets)
    block_flops, _ = count_flops(small_gpt(1).h[0], torch.randn(B, T, C))
    model = apply_selective_checkpointing(small_gpt(3))
    got = step_flops(model, idx, targets)
    assert got == plain, (
        f"selective checkpointing runs {got - plain:+,} FLOPs over no checkpointing, expected 0 "
        f"(FlopCounterMode counts matmuls; one block's forward is {block_flops:,}): is a matmul "
        f"recomputed (policy not applied, or addmm/bmm missing from the saved ops)?")
    check_measured(model, reference, "the default policy")
    full = step_flops(fully_checkpointed(small_gpt(3)), idx, targets)
    assert full == plain + 3 * block_flops, (  # the reference itself: full checkpointing's count
        f"the grader's reference (PyTorch's per-block checkpointing) counts {full - plain:,} extra "
        f"FLOPs, expected 3 × {block_flops:,}: FlopCounterMode or torch.utils.checkpoint changed?")


@pytest.mark.exercise("5.4", points=2)
def test_selective_checkpointing_holds_the_input_and_matmul_outputs():
    """Check MemTracker's bytes after forward: full + L × (matmul outputs of a block) exactly."""
    from labkit.harness.lab5 import apply_selective_checkpointing

    n_layers = 3
    with _MatmulOutputBytes() as counter:
        small_gpt(1).h[0](torch.randn(B, T, C))
    grads = []
    held_none, peak_none = blocks_memory(small_gpt(n_layers), grads)
    held_full, _ = blocks_memory(fully_checkpointed(small_gpt(n_layers)))
    held_sel, peak_sel = blocks_memory(apply_selective_checkpointing(small_gpt(n_layers)), grads)
    want = n_layers * counter.nbytes
    assert held_sel - held_full == want, (
        f"selective holds {held_sel - held_full:+,} B over full checkpointing after forward, "
        f"expected {want:,} (the matmul outputs of {n_layers} blocks): "
        f"{'nothing saved: is the policy applied?' if held_sel == held_full else 'does the policy save more or fewer ops than the GEMMs?'}")
    assert held_sel < held_none and peak_sel < peak_none, (
        f"selective holds {held_sel:,} B (peak {peak_sel:,}), no checkpointing {held_none:,} "
        f"(peak {peak_none:,}): selective must hold less")
    torch.testing.assert_close(grads[1], grads[0], **GRAD_TOL, msg=lambda m: (
        f"the input gradient of the selective step whose bytes were measured differs from the "
        f"plain blocks': {m} — does each block run on its own input, its output flowing on?"))


@pytest.mark.parametrize("block,policy,error,words", [
    (None, None, TypeError, "block must be an nn.Module"),
    (lambda x: x, None, TypeError, "block must be an nn.Module"),
    (torch.nn.Identity(), 5, TypeError, "policy must be callable"),
])
def test_the_block_refuses_what_it_cannot_checkpoint_naming_it(block, policy, error, words):
    """Given checks in the constructor: a block that is no module is named when built, not a
    "'NoneType' object is not callable" from inside checkpoint at the first forward."""
    from labkit.lab5.selective_checkpoint import SelectiveCheckpointBlock

    with pytest.raises(error, match=words):
        SelectiveCheckpointBlock(block, policy)
