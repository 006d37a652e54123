"""Graders of lab 5's exercise 5.9 (labs/05_activations.ipynb): chunked cross-entropy.

References nobody in this course wrote: ``F.cross_entropy`` on the whole logits (values and,
through autograd, gradients; float64 for the tight checks), a dispatch mode written here that
sees every tensor an operator creates (no tile larger than chunk × V, ever), autograd's
saved-tensor hooks (nothing of size N × V kept for backward) and ``MemTracker``
(``labkit.measure.peak_bytes``) for the peak the chapter predicts:

    peak ≈ d hidden + d weight + 2 · chunk · V · 4 bytes   (float32 logits tiles)

against ≥ 3 · N · V · 4 for the plain loss (log-probabilities kept, their gradient, the
logits' gradient). Byte counts are exact; numeric tolerances are stated where used.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.measure import peak_bytes, saved_activation_bytes
from _lab5_helpers import one_thread  # noqa: F401  (autouse fixture)
from _lab5_helpers import refuses
from _given import ctx_bytes, given

IGNORE = -100


def _problem(n, d, v, dtype=torch.float32, seed=0, ignore_every=0):
    """hidden (n, d), weight (v, d) scaled so the logits spread over a few units, targets."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g, dtype=torch.float64) / d ** 0.5 * 2).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        targets[::ignore_every] = IGNORE
    return hidden, weight, targets


def _reference(hidden, weight, targets, scale=1.0):
    """F.cross_entropy on the whole logits (cast as the contract says), its loss and gradients."""
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    acc = torch.promote_types(h.dtype, torch.float32)
    loss = F.cross_entropy((h @ w.T).to(acc), targets, ignore_index=IGNORE)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


def _ours(hidden, weight, targets, chunk_size, scale=1.0):
    from labkit.lab5.chunked_cross_entropy import chunked_cross_entropy

    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    with given("chunked_cross_entropy (forward, then backward)", hidden=h, weight=w, targets=targets):
        loss = chunked_cross_entropy(h, w, targets, chunk_size)
        (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


# float32 against F.cross_entropy: chunked sums add the same terms in another order, a few
# float32 ulps (measured 3e-9 on d hidden, 3e-8 on d weight at V = 1000; the loss is a mean of ~7)
F32_TOL = dict(atol=1e-6, rtol=1e-5)


def _check_measured(loss, h, w, targets, what):
    """A measurement counts only for the right result: the loss of the call whose memory was
    measured, and the gradients its backward left on ``h`` and ``w`` (float32 leaves), must be
    F.cross_entropy's on the same inputs (F32_TOL)."""
    want = _reference(h, w, targets)
    for name, got, ref in zip(("loss", "d hidden", "d weight"), (loss, h.grad, w.grad), want):
        assert got is not None, f"{what}: {name} is None after backward of the measured call"
        torch.testing.assert_close(got.detach(), ref, **F32_TOL, msg=lambda m, name=name: (
            f"{what}: {name} of the call whose memory was measured differs from F.cross_entropy's: "
            f"{m} — is every chunk's loss and gradient computed (none skipped while measured)?"))


# (N, d, V, chunk): chunks that divide N, that do not, of one token, of more than N
SHAPES = [(96, 16, 200, 32), (100, 16, 257, 7), (37, 8, 50, 1), (40, 8, 64, 1000)]


@pytest.mark.exercise("5.9", points=3)
@pytest.mark.parametrize("n,d,v,chunk", SHAPES)
def test_loss_and_gradients_equal_f_cross_entropy_in_float64(n, d, v, chunk):
    """Check the loss, d hidden and d weight against F.cross_entropy on the whole float64 logits.

    1e-10: float64 rounding of sums over a few hundred terms is ~1e-14; a chunk whose slice is
    off by one, a gradient missing its −1 at the target or its 1/N are off by 1e-3 or more.
    """
    hidden, weight, targets = _problem(n, d, v, torch.float64, seed=n)
    want = _reference(hidden, weight, targets)
    got = _ours(hidden, weight, targets, chunk)
    for name, g, w in zip(("loss", "d hidden", "d weight"), got, want):
        assert g is not None, f"{name} is None: does backward return a gradient for it?"
        assert g.dtype == torch.float64, f"{name} of float64 inputs came back in {g.dtype}"
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10, msg=lambda m, name=name: (
            f"{name}, N={n} V={v} chunk={chunk}: {m} — every chunk (the last one shorter) "
            "counted once, the gradient softmax − onehot over the counted tokens?"))


@pytest.mark.exercise("5.9", points=1)
def test_float32_matches_f_cross_entropy():
    """Check float32 inputs (N = 300 in chunks of 64, V = 1000) against F.cross_entropy, and
    logits of several hundred (N = 64 in chunks of 16), where a log-sum-exp without the row max
    overflows.

    atol 1e-6, rtol 1e-5: chunked sums add the same terms in another order, a few float32 ulps
    (measured 3e-9 on d hidden, 3e-8 on d weight); the loss is a mean of ~7 (F32_TOL).
    """
    hidden, weight, targets = _problem(300, 32, 1000)
    want, got = _reference(hidden, weight, targets), _ours(hidden, weight, targets, 64)
    for name, g, w in zip(("loss", "d hidden", "d weight"), got, want):
        assert g.dtype == torch.float32, f"{name} of float32 inputs came back in {g.dtype}"
        torch.testing.assert_close(g, w, **F32_TOL, msg=lambda m, name=name: f"{name}: {m}")
    # Large logits (up to ~900, where exp overflows float32 past 88.7), as F.cross_entropy takes
    # them: the log-sum-exp must subtract the row max. The loss (~660) to F32_TOL; the gradients
    # carry the float32 rounding of logits of ~900 (~5e-5 each) through softmax and · W (entries
    # ~35): atol 5e-4, rtol 1e-4 (measured 4.8e-5 on d hidden, 1.1e-6 on d weight).
    hidden, weight, targets = _problem(64, 32, 1000, seed=7)
    with torch.no_grad():
        weight.mul_(100)
    want, got = _reference(hidden, weight, targets), _ours(hidden, weight, targets, 16)
    for name, g, w, tol in zip(("loss", "d hidden", "d weight"), got, want,
                               (F32_TOL, *[dict(atol=5e-4, rtol=1e-4)] * 2)):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, name=name: (
            f"{name} with logits up to ~900: {m} — is the log-sum-exp computed stably (the row "
            "max subtracted before exp, as torch.logsumexp does)?"))


@pytest.mark.exercise("5.9", points=2)
def test_ignored_targets_count_for_nothing_and_the_gradient_follows_the_caller():
    """Check targets equal to -100 (every 3rd token): the loss is the mean over the others only,
    the ignored tokens' rows of d hidden are exactly 0, and backward scales by the incoming
    gradient ((loss · 2.5).backward(), as under gradient accumulation or a loss scaler); with
    every target ignored the loss is NaN, as F.cross_entropy's."""
    hidden, weight, targets = _problem(90, 16, 300, torch.float64, ignore_every=3)
    want = _reference(hidden, weight, targets, scale=2.5)
    got = _ours(hidden, weight, targets, 16, scale=2.5)
    torch.testing.assert_close(got[0], want[0], atol=1e-10, rtol=1e-10, msg=lambda m: (
        f"loss with ignored targets: {m} — is the mean over the counted tokens only (not over N)?"))
    ignored = targets == IGNORE
    assert got[1][ignored].abs().max() == 0, (
        f"d hidden of ignored tokens is {got[1][ignored].abs().max().item():.2e}, expected exactly 0: "
        "an ignored token's row must contribute nothing (not even its softmax)")
    for name, g, w in zip(("d hidden", "d weight"), got[1:], want[1:]):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10, msg=lambda m, name=name: (
            f"{name} of 2.5 × loss: {m} — does backward multiply by grad_loss, and divide by the "
            "number of counted tokens?"))
    # Two whole chunks of ignored targets (tokens 16-47, chunks of 16): their rows of d hidden
    # are exactly 0 as well, however backward walks the chunks.
    targets = targets.clone()
    targets[16:48] = IGNORE
    want = _reference(hidden, weight, targets)
    got = _ours(hidden, weight, targets, 16)
    assert torch.equal(got[1][16:48], torch.zeros_like(got[1][16:48])), (
        f"chunks 1 and 2 (tokens 16-47) have only ignored targets: their rows of d hidden hold "
        f"{int((got[1][16:48] != 0).sum())} non-zero entries, expected exactly 0 — a chunk without a "
        "counted token still needs its rows of d hidden written (torch.empty_like is not zeros)")
    for name, g, w in zip(("d hidden", "d weight"), got[1:], want[1:]):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10, msg=lambda m, name=name: (
            f"{name} with two whole chunks of ignored targets: {m}"))
    # Every target ignored: F.cross_entropy's mean over no token is 0/0 = NaN, and so is ours.
    targets = torch.full_like(targets, IGNORE)
    loss = _ours(hidden, weight, targets, 16)[0]
    assert torch.isnan(loss), (
        f"loss with every target ignored is {loss.item()}, F.cross_entropy gives "
        f"{_reference(hidden, weight, targets)[0].item()}: divide by the count of counted tokens as it is "
        "(no clamp to 1), as F.cross_entropy does")


@pytest.mark.exercise("5.9", points=1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_reduce_in_float32(dtype):
    """Check 16-bit hidden and weight: the loss is float32 and within 2e-5 of the float64 loss of
    the same (rounded) logits; d hidden and d weight in the input dtype, close to float64's.

    2e-5: a float32 log-sum-exp over 4096 entries lands ~1e-6 from float64; kept in bfloat16
    it is ~1e-2 off, float16 ~1e-3. Gradients: rounding to the 16-bit output dtype costs half an
    ulp of the largest entries: rtol 1.6e-2 (bfloat16), 2e-3 (float16), atol 1e-3 (entries ~1e-2).
    """
    hidden, weight, targets = _problem(256, 32, 4096, dtype, seed=5)
    got = _ours(hidden, weight, targets, 64)
    assert got[0].dtype == torch.float32, f"the loss of {dtype} inputs is {got[0].dtype}, expected float32"
    logits = (hidden.detach() @ weight.detach().T).double()  # the 16-bit logits, exactly
    exact = F.cross_entropy(logits, targets)
    assert abs(got[0].double() - exact) <= 2e-5, (
        f"loss of {dtype} inputs {got[0].item():.7f}, exact {exact.item():.7f}: is the "
        f"log-sum-exp computed in {dtype} instead of float32?")
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    F.cross_entropy(h64 @ w64.T, targets).backward()
    rtol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3
    for name, g, w in (("d hidden", got[1], h64.grad), ("d weight", got[2], w64.grad)):
        assert g.dtype == dtype, f"{name} of {dtype} inputs came back in {g.dtype}"
        torch.testing.assert_close(g.double(), w, atol=1e-3, rtol=rtol, msg=lambda m, name=name: (
            f"{name} of {dtype} inputs: {m} — accumulated in {dtype}?"))


@pytest.mark.exercise("5.9", points=1)
def test_16_bit_gradients_are_accumulated_in_float32_and_rounded_once():
    """Check bfloat16 inputs over 64 chunks of 4 tokens: d weight (summed over the chunks) and
    d hidden are the float64 gradients of the same 16-bit logits, rounded once to bfloat16.

    The reference takes the bfloat16 logits ``hidden @ weight.T`` exactly (in float64) and their
    float64 softmax, so it differs from the contract's computation only by rounding. Accumulated
    in float32 and rounded once, every entry of d weight lands within eps·|ref| + 1e-3·max|ref|
    of it (measured ≤ 0.4 of that over 8 seeds; d hidden, rounded twice, within twice that);
    summed in bfloat16 chunk after chunk, d weight drifts 3 to 5 times past it, and logits
    recomputed by a float32 matmul (not the input dtype's, as forward took them) 2.5 to 6 times.
    """
    dtype = torch.bfloat16
    hidden, weight, targets = _problem(256, 32, 512, dtype, seed=5)
    _, d_hidden, d_weight = _ours(hidden, weight, targets, 4)
    h, w = hidden.detach(), weight.detach()
    p = (h @ w.T).double().softmax(dim=1)  # the 16-bit logits, exactly, and their softmax
    p[torch.arange(len(targets)), targets] -= 1
    p /= len(targets)
    eps = torch.finfo(dtype).eps
    for name, got, ref, k in (("d weight", d_weight, p.T @ h.double(), 1), ("d hidden", d_hidden, p @ w.double(), 2)):
        err = (got.double() - ref).abs()
        tol = k * (eps * ref.abs() + 1e-3 * ref.abs().max())
        worst = int((err / tol).argmax())
        assert bool((err <= tol).all()), (
            f"{name} of bfloat16 inputs, chunk 4 of 256 tokens: entry {worst} is "
            f"{got.reshape(-1)[worst].item():.6g}, the float64 value {ref.reshape(-1)[worst].item():.6g} "
            f"(off by {err.reshape(-1)[worst].item():.3g}, allowed {tol.reshape(-1)[worst].item():.3g}): is "
            f"d weight summed over the chunks in bfloat16 instead of a float32 accumulator, or are the "
            f"logits recomputed in another dtype than forward's (hidden @ weight.T in the input dtype)?")


class _LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an operator returns (views included)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return out


@pytest.mark.exercise("5.9", points=2)
@pytest.mark.parametrize("chunk", [32, 100])
def test_no_tensor_larger_than_one_chunk_of_logits_is_ever_created(chunk):
    """Check, with a dispatch mode that sees every operator's outputs in forward and backward,
    that no tensor has more than chunk × V elements (N = 512 tokens, V = 2048: the whole
    logits are 512 × 2048); and that the loss and gradients of that run are F.cross_entropy's."""
    hidden, weight, targets = _problem(512, 16, 2048)
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    from labkit.lab5.chunked_cross_entropy import chunked_cross_entropy

    with given("chunked_cross_entropy (forward, then backward)", hidden=h, weight=w,
               targets=targets), _LargestTensor() as seen:
        loss = chunked_cross_entropy(h, w, targets, chunk)
        loss.backward()
    assert seen.largest <= chunk * 2048, (
        f"a tensor of {seen.largest:,} elements was created ({seen.op}), more than one chunk of "
        f"logits ({chunk} × 2048 = {chunk * 2048:,}): the whole (N × V) logits, or several chunks "
        "kept together, exist at some point")
    _check_measured(loss, h, w, targets, f"chunk {chunk}")


@pytest.mark.exercise("5.9", points=1)
def test_backward_keeps_no_logits():
    """Check what autograd saves: at most hidden, weight, targets and one float32 per token
    (saved-tensor hooks count every saved storage once); the plain loss saves N × V floats. The
    measured call's loss, and the gradients backward computes from what it saved, must be
    F.cross_entropy's."""
    from labkit.lab5.chunked_cross_entropy import chunked_cross_entropy

    n, d, v = 512, 16, 2048
    hidden, weight, targets = _problem(n, d, v)
    out = []
    with given("chunked_cross_entropy's forward", hidden=hidden, weight=weight, targets=targets):
        saved = saved_activation_bytes(lambda: out.append(chunked_cross_entropy(hidden, weight, targets, 64)))
    # what the Function keeps as ctx attributes (not through save_for_backward) counts too; the
    # contract's ctx holds a few 0-d tensors at most (the token count): 64 bytes of room
    saved += ctx_bytes(out[0], skip=(hidden, weight, targets))
    allowed = (n * d + v * d) * 4 + n * 8 + n * 4 + 64
    assert saved <= allowed, (
        f"backward keeps {saved:,} bytes, more than hidden + weight + targets + one float32 per "
        f"token = {allowed:,} (the logits of one chunk are {64 * v * 4:,} bytes): are logits, "
        "probabilities or per-chunk tensors saved for backward, or kept as ctx attributes?")
    with given("chunked_cross_entropy's backward", hidden=hidden, weight=weight, targets=targets):
        out[0].backward()
    _check_measured(out[0], hidden, weight, targets, "saved bytes, chunks of 64")


def _peak(fn, hidden, weight, targets, *extra):
    """MemTracker's peak of fn's forward + backward, and (loss, h, w) of that very run."""
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()

    def step():
        loss = fn(h, w, targets, *extra)
        loss.backward()
        return loss.detach()
    with given(f"{fn.__name__} (forward, then backward)", hidden=h, weight=w, targets=targets):
        peak, loss = peak_bytes(step)
    return peak, (loss, h, w)


def _plain(h, w, t):
    return F.cross_entropy(h @ w.T, t)


@pytest.mark.exercise("5.9", points=2)
def test_peak_memory_is_inputs_gradients_and_two_tiles_and_does_not_grow_with_n_times_v():
    """Check MemTracker's peak of forward + backward (d = 64, V = 8192, chunks of 64) against
    the chapter's bound: hidden and weight (MemTracker counts the inputs the step touches), their
    gradients, and two (chunk × V) float32 tiles, plus one more N × d float32 of allowance for
    the vectors of N entries and a chunk's (chunk × d) products (the reference uses 0.04 of a
    tile of it). And its growth from N = 256 to N = 1024 tokens: only N × d and N terms may
    grow (hidden and d hidden, the targets and log-sum-exps: ≤ 768 · (2d + 8) · 4 bytes), where
    the plain loss grows by at least 3 · 768 · V · 4. The measured runs' loss and gradients must
    be F.cross_entropy's."""
    from labkit.lab5.chunked_cross_entropy import chunked_cross_entropy

    d, v, chunk = 64, 8192, 64
    tile = chunk * v * 4
    peaks = {}
    for n in (256, 1024):
        hidden, weight, targets = _problem(n, d, v, seed=n)
        peaks[n], run = _peak(chunked_cross_entropy, hidden, weight, targets, chunk)
        state = 2 * (n * d + v * d) * 4  # inputs and their gradients
        allowed = state + 2 * tile + n * d * 4
        assert peaks[n] <= allowed, (
            f"N={n}: peak {peaks[n]:,} bytes = inputs and gradients {state:,} + "
            f"{(peaks[n] - state) / tile:.2f} tiles of {tile:,}; the chapter's bound is inputs + "
            f"gradients + 2 tiles (allowed {allowed:,}): logits of several chunks alive together?")
        _check_measured(*run, targets, f"N={n}, V={v}, chunks of {chunk}")
        if n == 256:
            plain_small = _peak(_plain, hidden, weight, targets)[0]
    plain_big = _peak(_plain, hidden, weight, targets)[0]
    assert plain_big - plain_small >= 3 * 768 * v * 4  # the reference really holds N × V tensors
    growth = peaks[1024] - peaks[256]
    allowed_growth = 768 * (2 * d + 8) * 4
    assert growth <= allowed_growth, (
        f"from N = 256 to 1024 the peak grew by {growth:,} bytes, more than the N × d and N terms "
        f"({allowed_growth:,}; the plain loss grew by {plain_big - plain_small:,}): something of "
        "size N × V is alive at once")


# ---------------------------------------------------------------- given code (not graded)

def test_bad_arguments_are_refused_naming_them():
    from labkit.lab5.chunked_cross_entropy import chunked_cross_entropy

    h, w, t = torch.randn(8, 4), torch.randn(10, 4), torch.randint(0, 10, (8,))
    refuses([
        ("chunk 0", lambda: chunked_cross_entropy(h, w, t, 0), ValueError, "chunk_size"),
        ("weight width", lambda: chunked_cross_entropy(h, torch.randn(10, 5), t), ValueError, "weight"),
        ("target 10", lambda: chunked_cross_entropy(h, w, torch.full((8,), 10)), ValueError, "targets"),
        ("float targets", lambda: chunked_cross_entropy(h, w, t.float()), ValueError, "targets"),
        ("dtypes", lambda: chunked_cross_entropy(h, w.double(), t), TypeError, "dtype"),
        ("hidden 3-D", lambda: chunked_cross_entropy(h[None], w, t), ValueError, "hidden"),
    ])


def test_plain_cross_entropy_is_f_cross_entropy():
    from labkit.lab5.chunked_cross_entropy import plain_cross_entropy

    hidden, weight, targets = _problem(20, 8, 30, torch.float64, ignore_every=4)
    torch.testing.assert_close(plain_cross_entropy(hidden, weight, targets),
                               _reference(hidden, weight, targets)[0], atol=0, rtol=0)
