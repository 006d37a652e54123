"""Ring attention (context parallelism): cut the sequence across ranks, pass keys and values around.

With N ranks, rank r holds a contiguous 1/N of the sequence: queries, keys and values of
positions [r·S/N, (r+1)·S/N). Attention needs every query against every key, so the key/value
blocks travel a ring: at step t rank r computes its queries against the block that started on
rank (r - t) mod N, while it sends the block it holds to rank r+1 and receives the next from
rank r-1. After N steps each query has seen every key. The partial results of the steps are
merged exactly with the online-softmax rule: with L the log-sum-exp of a partial result's
score rows,

    L = log(exp(L₁) + exp(L₂)),    O = exp(L₁ - L)·O₁ + exp(L₂ - L)·O₂.

Causal masking skips the blocks that lie entirely after a rank's queries (src > r) and masks
the diagonal block (src = r). No rank ever holds more than two key/value blocks (and, where
no fused kernel is used, one (S/N × S/N) tile of scores): memory O(S/N) per rank for the activations, and the sequence length
grows with the number of ranks (Liu et al. 2023, https://arxiv.org/abs/2310.01889). Each rank
sends N - 1 key/value blocks a step: 2·(N-1)·B·H·(S/N)·D elements.

Causal balance (``layout="zigzag"``). With contiguous chunks and a causal mask rank r computes
r whole blocks and its own block under the mask (the others lie after its queries): with
c = S/N, r·c² + c(c+1)/2 score entries a head, so the last rank does ((2N-1)·c + 1)/(c + 1),
about 2N - 1 times the first one's work. Zigzag (Brandon et al. 2023, https://arxiv.org/abs/2311.09431, and the context
parallelism of Megatron-LM) cuts the sequence into 2N pieces of S/(2N) positions and gives rank r
pieces r and 2N-1-r, one early and one late: every step then costs every rank the same
(S/N)²/2 score entries, and nothing the mask hides is computed.

Lab 5 (labs/05_activations.ipynb), exercise 5.7; Chapter 5 (book/05_activations.md).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.attention_blocks import attention_with_lse, check_chunk, count_attention_work
from labkit.validate import non_negative_int, one_of, positive_int, tensor

# ==== given: the course's code — read it, call it, don't change it ====

LAYOUTS = ("contiguous", "zigzag")
"""How the sequence is cut over the ranks (see :func:`rank_positions`)."""

__all__ = ["LAYOUTS", "attention_with_lse", "count_attention_work", "merge_attention",
           "ring_attention", "rank_positions"]
# attention_with_lse(q, k, v, causal=...) -> (O, L) and count_attention_work() are given
# (labkit.attention_blocks): one key block's attention with the log-sum-exp of its rows.

# ==== exercise 5.7: your code ====

def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint sets of keys (the online-softmax rule).

    Args:
        out_a, out_b: (B, H, S, D) attention of the same queries over two sets of keys.
        lse_a, lse_b: (B, H, S) log-sum-exp of the score rows of each part.
    Returns:
        (O, L): the attention over the union of the keys and its log-sum-exp,
        L = logaddexp(L_a, L_b), O = exp(L_a - L)·O_a + exp(L_b - L)·O_b.
    """
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        tensor(name, t, floating=True)
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:-1]:
        raise ValueError(f"out_a, out_b must be (B, H, S, D) and lse_a, lse_b (B, H, S), alike; "
                         f"got {tuple(out_a.shape)}, {tuple(lse_a.shape)}, {tuple(out_b.shape)}, "
                         f"{tuple(lse_b.shape)}")
    if out_a.dtype != out_b.dtype or lse_a.dtype != lse_b.dtype:
        raise TypeError(f"out_a, out_b (and lse_a, lse_b) must share one dtype, got {out_a.dtype}, "
                        f"{out_b.dtype} ({lse_a.dtype}, {lse_b.dtype})")
    devices = [str(t.device) for t in (out_a, lse_a, out_b, lse_b)]
    if len(set(devices)) != 1:
        raise ValueError(f"out_a, lse_a, out_b, lse_b must be on one device, got {devices}")
    # BEGIN SOLUTION 5.7: combine the two partial results exactly
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b
    return out, lse
    # END SOLUTION


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   group: dist.ProcessGroup | None = None,
                   layout: str = "contiguous") -> torch.Tensor:
    """This rank's rows of attention over the whole sequence, keys and values passed round a ring.

    Call it on every rank of ``group`` at once, with chunks of one shape on every rank (the
    sequence split evenly; ``ring_worker`` refuses an uneven split). Rank r holds the positions
    ``rank_positions(S, N, r, layout)`` of q, k and v, in increasing order. For step
    t = 0..N-1: if t < N-1, start sending the key/value block held now to rank r+1 and
    receiving the next one from rank r-1 (``dist.isend`` / ``dist.irecv``, so the transfer
    overlaps the compute); attend to the block held (from rank src = (r - t) mod N) with
    ``attention_with_lse`` and merge the part into the running result with
    ``merge_attention``; wait for the transfer.

    Causal attention computes no score the mask hides: ``attention_with_lse`` is called with
    ``causal=True`` only on the rank's own block (t = 0) and unmasked on exactly the query rows
    and key rows that see each other otherwise.

    - ``"contiguous"``: rank r holds [r·S/N, (r+1)·S/N); a block from src > r lies after
      every query and is skipped.
    - ``"zigzag"``: rank r holds pieces r and 2N-1-r of 2N equal pieces (first half of its
      rows, second half); every step costs every rank the same number of score entries.

    Args:
        q, k, v: this rank's chunk, (B, H, S/N, D) each (S/N even for ``"zigzag"``).
        causal: causal attention over the global positions.
        group: the process group (None: the default group).
        layout: ``"contiguous"`` or ``"zigzag"``: which positions the chunks hold.
    Returns:
        (B, H, S/N, D): the attention output of this rank's queries, in the chunk's row order.
    Raises:
        ValueError: an unknown ``layout``, or an odd chunk length for ``"zigzag"``.
    """
    check_chunk(q, k, v, causal)
    _check_layout(layout, q.shape[2])
    # BEGIN SOLUTION 5.7: attend to the block held while the key/value blocks travel round the ring; merge the partial results
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    send_to = dist.get_global_rank(group, (rank + 1) % world_size) if group is not None else (rank + 1) % world_size
    recv_from = (dist.get_global_rank(group, (rank - 1) % world_size) if group is not None
                 else (rank - 1) % world_size)
    half = q.shape[2] // 2  # zigzag: rows [0, half) are piece r, [half, 2·half) piece 2N-1-r
    out = lse = None
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for step in range(world_size):
        requests = []
        if step < world_size - 1:
            k_next, v_next = torch.empty_like(k_cur), torch.empty_like(v_cur)
            requests = [dist.isend(k_cur, send_to, group=group),
                        dist.isend(v_cur, send_to, group=group),
                        dist.irecv(k_next, recv_from, group=group),
                        dist.irecv(v_next, recv_from, group=group)]
        src = (rank - step) % world_size
        rows, part = None, None  # the query rows this step updates (None: all), their result
        if not causal or src == rank:  # held positions increase: the own block is plain causal
            part = attention_with_lse(q, k_cur, v_cur, causal=causal and src == rank)
        elif layout == "contiguous":
            if src < rank:  # an earlier block: every query sees every key
                part = attention_with_lse(q, k_cur, v_cur)
        elif src < rank:  # zigzag: both query pieces see the block's early piece, not its late one
            part = attention_with_lse(q, k_cur[:, :, :half], v_cur[:, :, :half])
        else:  # zigzag, src > r: only the late query piece sees the block, all of it
            rows = slice(half, None)
            part = attention_with_lse(q[:, :, rows], k_cur, v_cur)
        if out is None:  # step 0, the own block
            out, lse = part
        elif rows is None and part is not None:
            out, lse = merge_attention(out, lse, *part)
        elif part is not None:
            out[:, :, rows], lse[:, :, rows] = merge_attention(out[:, :, rows],
                                                               lse[:, :, rows], *part)
        for request in requests:
            request.wait()
        if requests:
            k_cur, v_cur = k_next, v_next
    return out
    # END SOLUTION


# ==== given: the course's code — read it, call it, don't change it ====

def _check_layout(layout, chunk_len: int | None = None) -> None:
    one_of("layout", layout, LAYOUTS)
    if layout == "zigzag" and chunk_len is not None and chunk_len % 2:
        raise ValueError(f"layout='zigzag' needs an even chunk (two pieces of S/(2N) positions), "
                         f"got a chunk of {chunk_len} positions in q: make S a multiple of 2N")


def rank_positions(seq_len: int, world_size: int, rank: int,
                   layout: str = "contiguous") -> torch.Tensor:
    """The global positions rank ``rank`` holds, in increasing order: a LongTensor of S/N.

    ``"contiguous"``: [rank·S/N, (rank+1)·S/N). ``"zigzag"``: pieces ``rank`` and
    ``2N-1-rank`` of the sequence cut into 2N pieces of S/(2N).

    Raises:
        ValueError: sizes that are not ints >= 1, ``rank`` outside [0, N), an unknown ``layout``,
            or ``seq_len`` not a multiple of N (of 2N for ``"zigzag"``).
    """
    positive_int("seq_len", seq_len)
    positive_int("world_size", world_size)
    non_negative_int("rank", rank)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    _check_layout(layout)
    pieces = world_size if layout == "contiguous" else 2 * world_size
    if seq_len % pieces:
        raise ValueError(f"seq_len={seq_len} must be a multiple of {pieces} for layout="
                         f"{layout!r} with world_size={world_size}")
    size = seq_len // pieces
    own = [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]
    return torch.cat([torch.arange(p * size, (p + 1) * size) for p in own])
