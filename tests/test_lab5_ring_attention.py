"""Graders of lab 5's exercise 5.7 (labs/05_activations.ipynb): ring attention and its zigzag layout.

References nobody in this course wrote: PyTorch's SDPA over the whole sequence (rows picked by
this file's own index arithmetic), the exact count of causal score entries S(S+1)/2 per head,
the ring's byte formula (``labkit.reference.lab5``) and ``MemTracker`` for the per-rank peak.
Every ring run is on real gloo ranks (``labkit.ranks.launch``), through the course's harness
``labkit.harness.lab5.ring_worker``.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from _lab5_helpers import one_thread  # noqa: F401  (autouse fixture)
from _lab5_helpers import ATTN_TOL, refuses
from _given import as_given


# ------------------------------------------------------------------ 5.7 ring attention

@pytest.mark.exercise("5.7", points=1)
def test_merge_attention_equals_attention_over_all_keys():
    """Check merging attention over two halves of the keys equals SDPA over all of them."""
    from labkit.lab5.ring_attention import attention_with_lse, merge_attention
    attention_with_lse, merge_attention = as_given(attention_with_lse), as_given(merge_attention)

    q, k, v = (torch.randn(2, 3, 40, 8) for _ in range(3))
    first = attention_with_lse(q, k[:, :, :15], v[:, :, :15])
    second = attention_with_lse(q, k[:, :, 15:], v[:, :, 15:])
    out, lse = merge_attention(*first, *second)
    full_scores = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    is_max = torch.allclose(lse, torch.maximum(first[1], second[1]))
    torch.testing.assert_close(lse, torch.logsumexp(full_scores, dim=-1), **ATTN_TOL,
                               msg=lambda m: f"merged L: {m}"
                               + (" — it equals max(L1, L2): the smaller part's mass is lost"
                                  if is_max else ""))
    is_mean = torch.allclose(out, (first[0] + second[0]) / 2)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), **ATTN_TOL,
                               msg=lambda m: f"merged O: {m}"
                               + (" — it equals (O1 + O2)/2: the parts are not weighted by their "
                                  "softmax mass" if is_mean else ""))


@pytest.mark.exercise("5.7", points=1)
def test_merge_attention_stays_finite_for_large_log_sum_exps():
    """Check merging parts whose log-sum-exps are ~±1,000 (scores that large occur in bf16 models
    without QK-norm): the float64 logaddexp, no overflow to inf or NaN."""
    from labkit.lab5.ring_attention import merge_attention
    merge_attention = as_given(merge_attention)

    torch.manual_seed(3)
    out_a, out_b = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    for shift in (1000.0, -1000.0):
        lse_a, lse_b = shift + torch.randn(1, 2, 8), shift + torch.randn(1, 2, 8)
        out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
        want_lse = torch.logaddexp(lse_a.double(), lse_b.double())
        w_a = torch.exp(lse_a.double() - want_lse)[..., None]
        want = w_a * out_a.double() + (1 - w_a) * out_b.double()
        torch.testing.assert_close(lse.double(), want_lse, **ATTN_TOL,
                                   msg=lambda m: f"merged L for L ≈ {shift:+g}: {m}")
        torch.testing.assert_close(out.double(), want, **ATTN_TOL,
                                   msg=lambda m: f"merged O for L ≈ {shift:+g}: {m}")


@pytest.mark.exercise("5.7", points=1)
def test_ring_attention_runs_inside_a_subgroup():
    """Check a 4-rank world split into two rings ({0, 1} and {2, 3}, ``group=`` given): each ring
    computes causal zigzag attention over the whole sequence. ``dist.isend``/``irecv`` take
    global ranks: a ring's neighbours must be translated from group ranks. The chunks are
    strided, as a model's (B, S, H, D) projections seen as (B, H, S, D) are: a collective
    needs contiguous tensors."""
    from labkit.ranks import launch
    from labkit.harness.lab5 import ring_worker

    torch.manual_seed(21)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    results = launch(ring_worker, 4, q, k, v, True, layout="zigzag", group_size=2, strided=True,
                     timeout=60)
    for rank, r in enumerate(results):
        rows = zigzag_rows(64, 2, rank % 2)
        torch.testing.assert_close(r["out"], want[:, :, rows], **ATTN_TOL,
                                   msg=lambda m, rank=rank: f"rank {rank} (rank {rank % 2} of its "
                                   f"group of 2): {m}")


def check_measured(q, k, v, results, causal, what, layout="contiguous"):
    """A measurement counts only for the right result: every rank of the run whose bytes, memory
    or work were measured must hold SDPA over the whole sequence at its rows (ATTN_TOL)."""
    s, n = q.shape[2], len(results)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    for rank, r in enumerate(results):
        rows = (zigzag_rows(s, n, rank) if layout == "zigzag"
                else torch.arange(rank * s // n, (rank + 1) * s // n))
        assert r["out"] is not None, f"{what}: rank {rank} of the measured run returned no output"
        torch.testing.assert_close(r["out"], want[:, :, rows], **ATTN_TOL, msg=lambda m, rank=rank: (
            f"{what}: rank {rank}'s output in the run whose bytes, memory or work were measured "
            f"differs from SDPA's at its rows: {m} — is every received block attended to and "
            f"merged?"))


RING_B, RING_H, RING_D = 1, 2, 16
RING_RUNS = [(128, 2, False), (128, 4, False), (128, 2, True), (128, 4, True), (256, 8, False)]


@pytest.fixture(scope="module")
def ring_runs():
    """One launch per (S, N, causal): the inputs and every rank's result."""
    from labkit.ranks import launch
    from labkit.harness.lab5 import ring_worker

    runs = {}
    for s, n, causal in RING_RUNS:
        torch.manual_seed(s + n)
        q, k, v = (torch.randn(RING_B, RING_H, s, RING_D) for _ in range(3))
        runs[s, n, causal] = (q, k, v, launch(ring_worker, n, q, k, v, causal, timeout=60))
    return runs


@pytest.mark.exercise("5.7", points=3)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_equals_full_attention(ring_runs, world_size, causal):
    """Check the ranks' outputs, concatenated, equal SDPA over the whole sequence."""
    q, k, v, results = ring_runs[128, world_size, causal]
    out = torch.cat([r["out"] for r in results], dim=2)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    chunk = out.shape[2] // world_size
    for rank in range(world_size):
        rows = slice(rank * chunk, (rank + 1) * chunk)
        torch.testing.assert_close(
            out[:, :, rows], want[:, :, rows], **ATTN_TOL,
            msg=lambda m: f"rank {rank}'s output rows (N={world_size}, causal={causal}): {m} — "
                          f"which source rank's block is held at step t, and which blocks does "
                          f"causal masking skip or mask?")


@pytest.mark.exercise("5.7", points=1)
def test_ring_bytes_sent_per_rank_match_the_formula(ring_runs):
    """Check count_comm: each rank sends (and receives) 2(N-1) blocks of B·H·(S/N)·D floats; and
    that the counted runs computed attention."""
    for (s, n, causal), (q, k, v, results) in ring_runs.items():
        expected = 2 * (n - 1) * RING_B * RING_H * (s // n) * RING_D * 4
        for rank, r in enumerate(results):
            sent = r["bytes_sent"].get("send", 0)
            assert sent == expected, (
                f"S={s}, N={n}, causal={causal}: rank {rank} sent {sent:,} B, expected "
                f"2(N-1)·B·H·(S/N)·D·4 = {expected:,}: one transfer too many (the last step "
                f"needs none) or too few?")
            assert r["bytes_sent"].get("recv", 0) == expected, (
                f"S={s}, N={n}: rank {rank} received {r['bytes_sent'].get('recv', 0):,} B, "
                f"expected {expected:,}")
            assert set(r["bytes_sent"]) <= {"send", "recv", "barrier"}, (
                f"rank {rank} used {sorted(r['bytes_sent'])}: the ring needs only send/recv")
        check_measured(q, k, v, results, causal, f"S={s}, N={n}, causal={causal}")


@pytest.mark.exercise("5.7", points=2)
def test_ring_per_rank_peak_memory_scales_with_s_over_n(ring_runs):
    """Check MemTracker's per-rank peak: same S/N, same peak (±10%); half S/N, a linear saving.

    Per rank the ring holds the key/value block being received (two tensors) and its running
    output, each B·H·(S/N)·D floats, beside a fixed scratch of the attention kernel: halving S/N
    must save at least those three blocks' halves, 3·(b(N=2) − b(N=4)) bytes. The measured runs
    must compute attention.
    """
    peak = {key: max(r["peak_bytes"] for r in run[3]) for key, run in ring_runs.items()}
    same = peak[256, 8, False] / peak[128, 4, False]
    assert abs(same - 1) <= 0.10, (
        f"per-rank peak at S=256, N=8 is {same:.2f}× the one at S=128, N=4 (same S/N): a rank "
        f"must hold O(S/N), not O(S): are all blocks kept instead of the current one? {peak}")
    block = lambda n: RING_B * RING_H * (128 // n) * RING_D * 4  # noqa: E731
    saving, want = peak[128, 2, False] - peak[128, 4, False], 3 * (block(2) - block(4))
    assert saving >= want, (
        f"going from 2 to 4 ranks at S=128 saves {saving:,} B of per-rank peak, expected at "
        f"least {want:,} (the received key/value block and the output, halved): {peak}")
    for (s, n, causal), (q, k, v, results) in ring_runs.items():
        check_measured(q, k, v, results, causal, f"S={s}, N={n}, causal={causal}")



# ---- the zigzag layout (causal balance)

B, H, D = 1, 2, 16
# (S, N, causal, layout): one launch each
RUNS = [(128, 2, True, "zigzag"), (128, 4, True, "zigzag"), (128, 4, False, "zigzag"),
        (128, 4, True, "contiguous")]


def zigzag_rows(seq_len: int, world_size: int, rank: int) -> torch.Tensor:
    """Rows of rank ``rank`` under zigzag, by hand: pieces r and 2N-1-r of 2N pieces."""
    piece = seq_len // (2 * world_size)
    first = list(range(rank * piece, (rank + 1) * piece))
    last = 2 * world_size - 1 - rank
    return torch.tensor(first + list(range(last * piece, (last + 1) * piece)))


class _ScoreWork(TorchDispatchMode):
    """The attention work an operator stream does, seen at the dispatcher: the FLOPs of every
    matrix product (2·m·n·k, in-place ones included; a matrix-vector or vector product too) and
    the score entries of every fused attention kernel (B·H·Sq·Sk; causal: the entries on or below
    the diagonal)."""

    PRODUCTS = {"mm": 0, "bmm": 0, "addmm": 1, "addmm_": 1, "baddbmm": 1, "baddbmm_": 1}
    VECTOR_PRODUCTS = {"mv": 0, "addmv": 1, "addmv_": 1, "dot": 0, "vdot": 0}  # 2·numel(matrix)

    def __init__(self):
        super().__init__()
        self.product_flops = self.fused_entries = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, kwargs = func.overloadpacket.__name__, kwargs or {}
        first = self.PRODUCTS.get(name)
        if first is not None:
            a, b = args[first], args[first + 1]
            self.product_flops += 2 * math.prod(a.shape) * b.shape[-1]
        elif name in self.VECTOR_PRODUCTS:  # scores a row at a time are scores too
            self.product_flops += 2 * args[self.VECTOR_PRODUCTS[name]].numel()
        elif name.startswith(("_scaled_dot_product", "_flash_attention", "_efficient_attention")):
            q, k = args[0], args[1]
            names = [a.name for a in func._schema.arguments]
            at = names.index("is_causal") if "is_causal" in names else len(args)
            causal = kwargs.get("is_causal", args[at] if at < len(args) else False)
            sq, sk = q.shape[-2], k.shape[-2]
            per_head = (sum(min(i + 1, sk) for i in range(sq)) if causal is True else sq * sk)
            self.fused_entries += math.prod(q.shape[:-2]) * per_head
        return func(*args, **kwargs)


def counted_ring_worker(rank, world_size, *args, **kwargs):
    """``ring_worker`` inside :class:`_ScoreWork` on this rank: its result, with
    ``"product_flops"`` and ``"fused_entries"`` added."""
    from labkit.harness.lab5 import ring_worker

    with _ScoreWork() as seen:
        result = ring_worker(rank, world_size, *args, **kwargs)
    return {**result, "product_flops": seen.product_flops, "fused_entries": seen.fused_entries}


def check_work_at_the_dispatcher(results, want, what):
    """The score entries each rank computed, counted at the dispatcher (so whatever computes
    them, with or without ``attention_with_lse``): fused attention kernels' entries plus the
    products' FLOPs / 4D (an entry costs 2D FLOPs in q·kᵀ and 2D in P·V), each rank's ``want``."""
    for rank, (r, expected) in enumerate(zip(results, want)):
        flops, fused = r["product_flops"], r["fused_entries"]
        got = fused + flops / (4 * D)
        assert got == expected, (
            f"{what}: rank {rank} computed {got:,.6g} score entries at the dispatcher ({fused:,} "
            f"in attention kernels, {flops:,} FLOPs of matrix products = {flops / (4 * D):,.6g} "
            f"entries at 4·D FLOPs each), expected {expected:,}: "
            + ("more: scores the mask hides computed and thrown away (a whole block, or a query "
               "piece that sees none of it)?" if got > expected else
               "fewer: is part of the attention skipped?"))


@pytest.fixture(scope="module")
def runs():
    """One launch per case: the inputs and every rank's result (with the work the dispatcher
    saw, :func:`counted_ring_worker`)."""
    from labkit.ranks import launch

    out = {}
    for s, n, causal, layout in RUNS:
        torch.manual_seed(10 * s + n)
        q, k, v = (torch.randn(B, H, s, D) for _ in range(3))
        out[s, n, causal, layout] = (q, k, v, launch(counted_ring_worker, n, q, k, v, causal,
                                                     layout=layout, timeout=60))
    return out


@pytest.mark.exercise("5.7", points=2)
@pytest.mark.parametrize("world_size, causal", [(2, True), (4, True), (4, False)])
def test_zigzag_ring_equals_sdpa_on_each_ranks_rows(runs, world_size, causal):
    """Check each rank's output equals SDPA over the whole sequence at the rows it holds
    (pieces r and 2N-1-r): the ranks' outputs, concatenated, are SDPA's on the re-ordered
    sequence."""
    q, k, v, results = runs[128, world_size, causal, "zigzag"]
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    for rank, r in enumerate(results):
        rows = zigzag_rows(128, world_size, rank)
        assert r["out"] is not None and r["out"].shape == (B, H, len(rows), D), (
            f"rank {rank} returned {None if r['out'] is None else tuple(r['out'].shape)}, "
            f"expected its chunk's shape {(B, H, len(rows), D)}")
        half = len(rows) // 2
        for name, got_rows, want_rows in (("early piece", slice(None, half), rows[:half]),
                                          ("late piece", slice(half, None), rows[half:])):
            torch.testing.assert_close(
                r["out"][:, :, got_rows], want[:, :, want_rows], **ATTN_TOL,
                msg=lambda m: f"rank {rank}'s {name} (positions {want_rows[0]}..{want_rows[-1]}, "
                              f"N={world_size}, causal={causal}): {m} — at a step with src < r, "
                              f"which half of the block do the queries see; with src > r, which "
                              f"query piece sees it?")


@pytest.mark.exercise("5.7", points=1)
@pytest.mark.parametrize("world_size", [2, 4])
def test_zigzag_ring_work_is_equal_on_every_rank(runs, world_size):
    """Check the score entries each rank computes (counted by ``count_attention_work`` and at
    the dispatcher): under zigzag every rank computes B·H·S(S+1)/(2N), its share of the S(S+1)/2
    causal entries per head, exactly — nothing the mask hides, and the same on every rank; and
    that the run computed attention."""
    s = 128
    want = B * H * s * (s + 1) // (2 * world_size)
    q, k, v, results = runs[s, world_size, True, "zigzag"]
    work = [r["work"] for r in results]
    for rank, got in enumerate(work):
        assert got == want, (
            f"zigzag, S={s}, N={world_size}: rank {rank} computed {got:,} score entries, expected "
            f"B·H·S(S+1)/(2N) = {want:,} (all ranks: {work}): "
            + ("no call to attention_with_lse? " if got == 0 else "")
            + ("more than its share: a block, or a query piece, the mask hides entirely is "
               "computed and thrown away?" if got > want else "fewer: a part is skipped?"))
    check_work_at_the_dispatcher(results, [want] * world_size, f"zigzag, S={s}, N={world_size}")
    check_measured(q, k, v, results, True, f"zigzag, S={s}, N={world_size}", "zigzag")


@pytest.mark.exercise("5.7", points=1)
def test_contiguous_ring_work_skips_the_blocks_after_the_queries(runs):
    """Check the contiguous causal ring's work per rank (counted by ``count_attention_work`` and
    at the dispatcher): rank r computes r whole blocks and its own block causally,
    B·H·(r·c² + c(c+1)/2) entries with c = S/N: the last rank does the most; and that the run
    computed attention."""
    s, n = 128, 4
    c = s // n
    q, k, v, results = runs[s, n, True, "contiguous"]
    work = [r["work"] for r in results]
    for rank, got in enumerate(work):
        want = B * H * (rank * c * c + c * (c + 1) // 2)
        assert got == want, (
            f"contiguous, S={s}, N={n}: rank {rank} computed {got:,} score entries, expected "
            f"B·H·(r·c² + c(c+1)/2) = {want:,} (all ranks: {work}): a block from src > r lies "
            f"after every query: skipped?")
    check_work_at_the_dispatcher(results, [B * H * (r * c * c + c * (c + 1) // 2) for r in range(n)],
                                 f"contiguous, S={s}, N={n}")
    check_measured(q, k, v, results, True, f"contiguous, S={s}, N={n}")


@pytest.mark.exercise("5.7", points=1)
def test_zigzag_ring_bytes_per_rank_match_the_formula(runs):
    """Check count_comm under zigzag: each rank sends and receives 2(N-1) blocks of B·H·(S/N)·D
    floats, as the contiguous ring does (the layout changes the work, not the traffic); and that
    the counted runs computed attention."""
    for (s, n, causal, layout), (q, k, v, results) in runs.items():
        if layout != "zigzag":
            continue
        want = 2 * (n - 1) * B * H * (s // n) * D * 4
        for rank, r in enumerate(results):
            for op in ("send", "recv"):
                got = r["bytes_sent"].get(op, 0)
                assert got == want, (
                    f"zigzag, S={s}, N={n}, causal={causal}: rank {rank} {op} {got:,} B, "
                    f"expected 2(N-1)·B·H·(S/N)·D·4 = {want:,}: does a step send only a part of "
                    f"the block, or one transfer too many?")
        check_measured(q, k, v, results, causal, f"zigzag, S={s}, N={n}, causal={causal}", "zigzag")


# ------------------------------------------------------------------ given code (not graded)

def test_rank_positions_cut_the_sequence_into_the_layouts_pieces():
    from labkit.lab5.ring_attention import rank_positions

    for n in (1, 2, 4):
        for layout in ("contiguous", "zigzag"):
            held = [rank_positions(64, n, r, layout) for r in range(n)]
            assert sorted(torch.cat(held).tolist()) == list(range(64)), (layout, n)
        for r in range(n):
            assert torch.equal(rank_positions(64, n, r, "zigzag"), zigzag_rows(64, n, r))
            assert torch.equal(rank_positions(64, n, r), torch.arange(r * 64 // n, (r + 1) * 64 // n))


# ---- bad input (not graded)

def _ring_cases():
    from labkit.harness import lab5 as harness
    from labkit.lab5 import ring_attention as r
    from labkit.reference import lab5 as ref

    x = torch.randn(1, 1, 40, 4)
    return [
        ("bytes world 0", lambda: ref.ring_bytes_per_rank(1, 1, 40, 4, 0), ValueError, "world_size"),
        ("bytes world -2", lambda: ref.ring_bytes_per_rank(1, 1, 40, 4, -2), ValueError,
         "world_size"),
        ("bytes world float", lambda: ref.ring_bytes_per_rank(1, 1, 40, 4, 2.0), ValueError,
         "world_size"),
        ("bytes uneven", lambda: ref.ring_bytes_per_rank(1, 1, 40, 4, 3), ValueError, "seq_len"),
        ("bytes element 0", lambda: ref.ring_bytes_per_rank(1, 1, 40, 4, 2, 0), ValueError,
         "element_size"),
        ("worker uneven split", lambda: harness.ring_worker(0, 3, x, x, x), ValueError, "seq_len"),
        ("worker layout", lambda: harness.ring_worker(0, 2, *(torch.zeros(1, 1, 8, 4),) * 3, True,
                                                      layout="zig"), ValueError, "layout"),
        ("worker zigzag odd chunk", lambda: harness.ring_worker(0, 4, *(torch.zeros(1, 1, 12, 4),) * 3,
                                                                True, layout="zigzag"), ValueError, "seq_len"),
        ("lse mixed dtypes", lambda: r.attention_with_lse(x, x.double(), x), TypeError, "dtype"),
        # named by dtype and shape, not by the tensor's printed values
        ("lse int q", lambda: r.attention_with_lse(x.long(), x, x), TypeError,
         r"q must be a floating \(B, H, S, D\) tensor, got a torch.int64 tensor of shape"),
        ("ring 3-D k", lambda: r.ring_attention(x, x[0], x), TypeError,
         r"k must be a floating \(B, H, S, D\) tensor, got a torch.float32 tensor of shape \("),
        ("lse causal uneven", lambda: r.attention_with_lse(x, x[:, :, :20], x[:, :, :20],
                                                           causal=True), ValueError, "causal"),
        ("merge shapes", lambda: r.merge_attention(x, x[..., 0], x[:, :, :20], x[..., 0]),
         ValueError, "out_a"),
        ("merge not a tensor", lambda: r.merge_attention(x.tolist(), x[..., 0], x, x[..., 0]),
         TypeError, "out_a"),
        ("merge mixed dtypes", lambda: r.merge_attention(x, x[..., 0], x.double(), x[..., 0]),
         TypeError, "dtype"),
        ("merge two devices", lambda: r.merge_attention(x, x[..., 0], x.to("meta"), x[..., 0]),
         ValueError, "device"),
        # an empty chunk: PyTorch's fused CPU kernel dies of SIGFPE on it (no traceback)
        ("lse empty chunk", lambda: r.attention_with_lse(x[:, :, :0], x[:, :, :0], x[:, :, :0]),
         ValueError, "position"),
        ("ring empty chunk", lambda: r.ring_attention(x[:, :, :0], x[:, :, :0], x[:, :, :0]),
         ValueError, "position"),
    ]


@pytest.mark.parametrize("call, exc, word", [
    (lambda r: r.rank_positions(64, 4, 0, "striped"), ValueError, "layout"),
    (lambda r: r.rank_positions(60, 4, 0, "zigzag"), ValueError, "seq_len"),
    (lambda r: r.rank_positions(64, 4, 4), ValueError, "rank"),
    (lambda r: r.rank_positions(64, 0, 0), ValueError, "world_size"),
    (lambda r: r.ring_attention(*(torch.zeros(1, 1, 3, 4),) * 3, layout="zigzag"), ValueError,
     "zigzag"),
])
def test_zigzag_refuses_bad_input_before_any_work(call, exc, word):
    from labkit.lab5 import ring_attention

    with pytest.raises(exc, match=word):
        call(ring_attention)


def test_bad_input_is_refused_with_the_argument_named():
    """Check each public function refuses bad input with ValueError/TypeError naming it, before any
    work. The checks sit outside the exercise blocks, so this passes on the stubs: not graded."""
    refuses(_ring_cases())
