"""Graders of lab 5's exercise 5.5 (labs/05_activations.ipynb): activation offloading.

References: a ledger of every tensor autograd saves (saved-tensor hooks of this file), the
plain model for gradients, and on CUDA the allocator's own counters.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from labkit.models import GPT, GPTConfig
from _lab5_helpers import one_thread  # noqa: F401  (autouse fixture)
from _lab5_helpers import GRAD_TOL, small_gpt, model_grads, data, refuses
from _given import given


# ------------------------------------------------------------------ 5.5 offload

def _saved_tensor_ledger(fn):
    """[(bytes, is parameter or a view of one, data key)] of every tensor autograd saves in fn().

    The data key is the plain computation of "the same data": the first element's address,
    dtype and element count, plus shape and strides unless the tensor is dense. The saved
    tensors stay alive in the ledger, so no address is reused while it is built.
    """
    ledger, keep = [], []

    def pack(t):
        is_param = isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
        start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        key = (t.dtype, start, t.numel())
        if not t.is_contiguous():
            key += (tuple(t.shape), tuple(t.stride()))
        ledger.append((t.numel() * t.element_size(), is_param, key))
        keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return ledger


def _expected_split(ledger, min_bytes):
    """(host bytes, host copies, shared saves, device bytes, device saves) by the contract."""
    host, shared, seen = [], 0, set()
    device = [n for n, is_param, _ in ledger if is_param or n < min_bytes]
    for n, is_param, key in ledger:
        if is_param or n < min_bytes:
            continue
        if key in seen:
            shared += 1
        else:
            seen.add(key)
            host.append(n)
    return sum(host), len(host), shared, sum(device), len(device)


def assert_grads_equal_plain(model, loss, what):
    """Backward of ``loss`` (small_gpt(2)'s, its saves packed by the offloader) gives the plain
    model's gradients exactly: unpack returns the very values pack was given."""
    idx, targets = data()
    reference = model_grads(small_gpt(2), idx, targets)
    loss.backward()
    for (name, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=0, rtol=0,
                                   msg=lambda m, name=name: f"{name}.grad {what}: {m} — "
                                                 f"does unpack return the tensor pack was given?")


@pytest.mark.exercise("5.5", points=2)
def test_offloaded_gradients_equal_the_plain_model():
    """Check gradients through offloaded saved tensors equal the plain model's, exactly."""
    from labkit.lab5.offload import ActivationOffloader

    idx, targets = data()
    model = small_gpt(2)
    with given("ActivationOffloader"), ActivationOffloader(min_bytes=1024):
        loss = model(idx, targets)
    assert_grads_equal_plain(model, loss, "through the offloader")


@pytest.mark.exercise("5.5", points=2)
@pytest.mark.parametrize("min_bytes", [0, 1024, 10**9])
def test_offloader_accounts_every_saved_tensor_by_where_it_lives(min_bytes):
    """Check host bytes/count = distinct saved non-parameter data ≥ min_bytes; device = the rest;
    and that backward through what the counted forward saved gives the plain model's gradients
    (the counts count only for saves that give them back)."""
    from labkit.lab5.offload import ActivationOffloader

    idx, targets = data()
    ledger = _saved_tensor_ledger(lambda: small_gpt(2)(idx, targets))
    host, host_count, shared, device, device_count = _expected_split(ledger, min_bytes)
    offloader = ActivationOffloader(min_bytes=min_bytes)
    model = small_gpt(2)
    with given("ActivationOffloader"), offloader:
        loss = model(idx, targets)
    assert offloader.device_bytes == device and offloader.device_count == device_count, (
        f"min_bytes={min_bytes}: device_bytes/count {offloader.device_bytes:,} B/"
        f"{offloader.device_count}, expected {device:,} B/{device_count} (parameters, views of "
        f"parameters and tensors under min_bytes): is a view of a parameter (weight.t()) sent "
        f"to the host, or the threshold compared with < instead of >=?")
    assert offloader.host_bytes == host, (
        f"min_bytes={min_bytes}: host_bytes {offloader.host_bytes:,}, expected {host:,} (each "
        f"distinct saved tensor once, by its own elements): is data saved twice (softmax's "
        f"output) copied twice, or a view counted by its whole storage?")
    assert offloader.host_count == host_count, (
        f"min_bytes={min_bytes}: host_count {offloader.host_count}, expected {host_count} "
        f"distinct copies ({shared} saves share data with an earlier one)")
    assert_grads_equal_plain(model, loss, f"through the counted forward, min_bytes={min_bytes}")


@pytest.mark.exercise("5.5", points=1)
def test_offloader_min_bytes_boundary_is_exclusive():
    """Check the threshold: a saved tensor of exactly min_bytes goes to the host, one element
    fewer stays on the device ("smaller than min_bytes stay")."""
    from labkit.lab5.offload import ActivationOffloader

    for numel, where in ((256, "host"), (255, "device")):
        x = torch.randn(numel, requires_grad=True)  # 4 bytes an element: 1,024 B or 1,020 B
        offloader = ActivationOffloader(min_bytes=1024)
        with given("ActivationOffloader (pack, then unpack in backward)", x=x):
            with given("ActivationOffloader"), offloader:
                y = (x * x).sum()  # mul saves x (twice: self and other)
            y.backward()
        got = {"host": offloader.host_bytes, "device": offloader.device_bytes}
        want = {"host": 4 * numel, "device": 0} if where == "host" else {"host": 0, "device": 8 * numel}
        assert got == want, (
            f"a saved tensor of {4 * numel} B with min_bytes=1024: got {got}, expected {want} "
            f"(tensors smaller than min_bytes stay on the device, the others go to the host once)")
        torch.testing.assert_close(x.grad, 2 * x.detach(), rtol=0, atol=0)


@pytest.mark.exercise("5.5", points=1)
def test_offloader_counts_a_view_by_its_own_bytes():
    """Check a saved slice of a larger tensor counts its 16 columns, not its 64-column storage."""
    from labkit.lab5.offload import ActivationOffloader

    x = torch.randn(64, 64, requires_grad=True)
    offloader = ActivationOffloader(min_bytes=1024)
    with given("ActivationOffloader (pack, then unpack in backward)", x=x):
        with given("ActivationOffloader"), offloader:
            y = x.exp()  # exp saves its output, 64·64·4 = 16,384 B
            z = y[:, :16].sin()  # sin saves its input: a (64, 16) view of y's storage
        z.sum().backward()
    want = 64 * 64 * 4 + 64 * 16 * 4
    assert offloader.host_bytes == want, (
        f"host_bytes {offloader.host_bytes:,} B, expected {want:,} (exp's output + the (64, 16) "
        f"view sin saves, 4,096 B): is the view counted by its storage's nbytes?")
    x_ref = x.detach().clone().requires_grad_()
    x_ref.exp()[:, :16].sin().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=0, rtol=0,
                               msg=lambda m: f"x.grad through the offloaded view: {m}")


@pytest.mark.exercise("5.5", points=1)
def test_offloader_copies_data_saved_twice_once():
    """Check naive attention's softmax output (saved by softmax and by the matmul) is one copy."""
    from labkit.lab5.offload import ActivationOffloader

    idx, targets = data()
    ledger = _saved_tensor_ledger(lambda: small_gpt(2, attention="naive")(idx, targets))
    _, host_count, shared, _, _ = _expected_split(ledger, 1024)
    assert shared >= 2, "harness: naive attention should save its probabilities twice per layer"
    offloader = ActivationOffloader(min_bytes=1024)
    model = small_gpt(2, attention="naive")
    with given("ActivationOffloader"), offloader:
        loss = model(idx, targets)
    assert offloader.host_count == host_count, (
        f"{offloader.host_count} host copies, expected {host_count}: {shared} saves show data "
        f"already copied (softmax's output, then the view the matmul saves); copy each once")
    loss.backward()
    reference = model_grads(small_gpt(2, attention="naive"), idx, targets)
    for (name, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=0, rtol=0,
                                   msg=lambda m: f"{name}.grad: {m} — does unpack of a shared "
                                                 f"copy return the shape of this save?")


@pytest.mark.exercise("5.5", points=1)
def test_offloader_copies_a_strided_view_saved_twice_once():
    """Check a transposed (non-contiguous) view saved by two matmuls is one copy: its data key
    (address, count, shape, strides) is the same at both saves; gradients stay exact."""
    from labkit.lab5.offload import ActivationOffloader

    def run(offloader=None):
        x = torch.randn(4, 32, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
        a, b = (torch.randn(4, 32, 8, generator=torch.Generator().manual_seed(i), requires_grad=True)
                for i in (1, 2))  # a, b need gradients too, so that each bmm saves xt
        with given("ActivationOffloader"), offloader or contextlib.nullcontext():
            xt = x.transpose(1, 2)  # (4, 16, 32), strided
            y = torch.bmm(xt, a).sum() + torch.bmm(xt, b).sum()  # both bmm save xt (and a, b)
        y.backward()
        return x.grad

    ledger = _saved_tensor_ledger(lambda: run())
    host, host_count, shared, _, _ = _expected_split(ledger, 1024)
    assert shared >= 1, "harness: the strided view should be saved twice"
    offloader = ActivationOffloader(min_bytes=1024)
    grad = run(offloader)
    got = (offloader.host_count, offloader.shared_count, offloader.host_bytes)
    assert got == (host_count, shared, host), (
        f"(host_count, shared_count, host_bytes) = {got}, expected {(host_count, shared, host)}: "
        f"the same strided view xt is saved by two bmm calls; copy it once, whatever its layout")
    torch.testing.assert_close(grad, run(), atol=0, rtol=0,
                               msg=lambda m: f"x.grad through the shared strided view: {m}")


@pytest.mark.exercise("5.5", points=1)
def test_offloader_entered_again_counts_each_forward_alone():
    """Check two micro-batches of the same batch, each forward in its own ``with offloader:``,
    both graphs alive until one backward of the summed loss (gradient accumulation): the counts
    are twice one forward's (each forward copies its own saves; none shares the first's
    records) and the gradients those of the plain model's two micro-batches."""
    from labkit.lab5.offload import ActivationOffloader

    idx, targets = data()
    ledger = _saved_tensor_ledger(lambda: small_gpt(1)(idx, targets))
    host, host_count, shared, _, _ = _expected_split(ledger, 0)
    model, offloader = small_gpt(1), ActivationOffloader(min_bytes=0)
    losses = []
    for _ in range(2):
        with given("ActivationOffloader"), offloader:
            losses.append(model(idx, targets))
    sum(losses).backward()
    got = (offloader.host_count, offloader.shared_count, offloader.host_bytes)
    want = (2 * host_count, 2 * shared, 2 * host)
    assert got == want, (
        f"after two forwards (host_count, shared_count, host_bytes) = {got}, expected {want} "
        f"(twice one forward's): is a record of the previous forward reused after the "
        f"offloader is entered again?")
    reference = small_gpt(1)
    sum(reference(idx, targets) for _ in range(2)).backward()
    for (name, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=0, rtol=0,  # the same sums in one order
                                   msg=lambda m: f"{name}.grad after two micro-batches: {m}")


@pytest.mark.exercise("5.5", points=2)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_gradients_on_cuda_equal_the_plain_model_under_a_slow_compute_stream():
    """Check on CUDA: exact gradients while the compute stream is slowed with torch.cuda._sleep.

    The sleeps make any missing synchronisation a visible race: a pack that copies before the
    compute stream wrote the tensor (no wait_stream), device memory reused before the copy read
    it (no record_stream), or an unpack that reads before the copy back ended (no wait_event).
    Freed device copies make the caching allocator hand their addresses to later activations: a
    pack that shares a record by address without checking that its tensor is still alive gives
    one tensor another's data. GPU-only by nature (a CPU keeps each saved tensor alive itself).
    """
    from labkit.lab5.offload import ActivationOffloader

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=256, n_layer=3, n_head=4, n_embd=256)
    reference = GPT(cfg).cuda()
    model = copy.deepcopy(reference)
    idx = torch.randint(256, (4, 256), device="cuda")
    targets = torch.randint(256, (4, 256), device="cuda")
    reference(idx, targets).backward()

    def slow(module, *args):
        torch.cuda._sleep(2_000_000)  # ≈ 1 ms of GPU cycles on the compute stream

    hooks = [m.register_forward_pre_hook(slow) for m in model.modules()]
    hooks += [m.register_full_backward_pre_hook(slow) for m in model.modules()
              if isinstance(m, torch.nn.Linear)]
    with given("ActivationOffloader"), ActivationOffloader(min_bytes=1024):
        loss = model(idx, targets)
    x = torch.empty(64 << 20, device="cuda")  # reuse freed device memory while copies run
    x.fill_(float("nan"))
    loss.backward()
    torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    for (name, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
        # not bit-exact: CUDA's embedding backward adds with atomics in any order; a race
        # gives garbage or NaN, far outside 1e-5 relative
        torch.testing.assert_close(q.grad, p.grad, **GRAD_TOL,
                                   msg=lambda m: f"{name}.grad on CUDA: {m} — a race between "
                                                 f"the copy stream and the compute stream?")


@pytest.mark.exercise("5.5", points=2)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_frees_device_memory_of_saved_activations():
    """Check on CUDA: device bytes held after forward fall from ≈ the saved bytes to ≈ 0."""
    from labkit.lab5.offload import ActivationOffloader

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=256)).cuda()
    idx = torch.randint(256, (8, 256), device="cuda")
    targets = torch.randint(256, (8, 256), device="cuda")

    def held_after_forward(offload):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        offloader = ActivationOffloader(min_bytes=1024)
        if offload:
            with given("ActivationOffloader"), offloader:
                loss = model(idx, targets)
        else:
            loss = model(idx, targets)
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # lets the allocator retire blocks freed on the side stream
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        model.zero_grad(set_to_none=True)
        return held, offloader

    plain, _ = held_after_forward(False)
    offloaded, offloader = held_after_forward(True)
    assert offloader.host_bytes > 0.9 * plain, (
        f"host_bytes {offloader.host_bytes:,} B, expected more than 90% of the {plain:,} B a forward "
        f"holds without offloading: are the large saved tensors copied (and counted) once each?")
    assert offloaded < 0.05 * plain, (
        f"device bytes held after an offloaded forward: {offloaded:,} B, expected under 5% of the "
        f"{plain:,} B held without offloading: does pack keep a reference to the device tensor (in "
        f"the record, a dict key, a closure), so that it is never freed?")



# ---- bad input (not graded)

def _offload_cases():
    from labkit.lab5 import offload as o

    return [
        ("min_bytes negative", lambda: o.ActivationOffloader(min_bytes=-1), ValueError,
         "min_bytes"),
        ("min_bytes float", lambda: o.ActivationOffloader(min_bytes=1.5), ValueError, "min_bytes"),
        ("bandwidth 0", lambda: o.transfer_seconds(10, 0), ValueError, "bandwidth"),
        ("bytes negative", lambda: o.transfer_seconds(-1, 1e9), ValueError, "nbytes"),
        ("flops_per_s negative", lambda: o.compute_seconds(10, -1), ValueError, "flops_per_s"),
        ("flops text", lambda: o.compute_seconds("10", 1e9), ValueError, "flops"),
    ]


def test_bad_input_is_refused_with_the_argument_named():
    """Check each public function refuses bad input with ValueError/TypeError naming it, before any
    work. The checks sit outside the exercise blocks, so this passes on the stubs: not graded."""
    refuses(_offload_cases())
