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

import math

import torch
import torch.distributed as dist

from contextlib import contextmanager
from typing import Iterator

from labkit.validate import boolean, non_negative_int, one_of, positive_int, tensor

# ==== given: the course's code — read it, call it, don't change it ====

LAYOUTS = ("contiguous", "zigzag")
"""How the sequence is cut over the ranks (see :func:`rank_positions`)."""

_work: list[int] | None = None  # score entries computed by attention_with_lse, while counted


@contextmanager
def count_attention_work() -> Iterator[list[int]]:
    """Count the score entries :func:`attention_with_lse` computes inside the block.

    Yields a one-element list whose item grows by B·H·Sq·Sk for each call (B·H·Sq·(Sq+1)/2 for a
    causal one: only the entries on or below the diagonal are computed). This counts the work a
    rank does, exactly, whatever the machine's load.
    """
    global _work
    previous, _work = _work, [0]
    try:
        yield _work
    finally:
        _work = previous


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                       causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q against one block of keys, and the log-sum-exp of each score row.

    Args:
        q: (B, H, Sq, D); k, v: (B, H, Sk, D).
        causal: mask key j > query i (for a block on the diagonal, Sq = Sk).
    Returns:
        (O, L): O (B, H, Sq, D) = softmax(q kᵀ/√D) v and L (B, H, Sq) = logsumexp of the rows.
    """
    _check_chunk(q, k, v, causal)
    if _work is not None:
        b, h, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        _work[0] += b * h * (sq * (sq + 1) // 2 if causal else sq * sk)
    if (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and not (q.requires_grad or k.requires_grad or v.requires_grad)):
        # PyTorch's fused CPU kernel returns the log-sum-exp too: no (Sq × Sk) matrix in memory
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal)
        return out, lse
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, Sq, Sk)
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Sq)
    return torch.exp(scores - lse[..., None]) @ v, lse


def _check_chunk(q, k, v, causal) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 4:
            raise TypeError(f"{name} must be a floating (B, H, S, D) tensor, got {t!r:.60}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q (B, H, Sq, D) and k, v (B, H, Sk, D) must agree, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if 0 in (q.shape[2], k.shape[2], q.shape[3]):  # the fused CPU kernel dies on empty input
        raise ValueError(f"q and k, v need at least one position and head_dim >= 1, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}")
    boolean("causal", causal)
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal needs as many keys as queries in a block, got "
                         f"{q.shape[2]} and {k.shape[2]}")


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
    raise NotImplementedError("exercise 5.7: combine the two partial results exactly (labs/05_activations.ipynb)")


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
    _check_chunk(q, k, v, causal)
    _check_layout(layout, q.shape[2])
    raise NotImplementedError("exercise 5.7: attend to the block held while the key/value blocks travel round the ring; merge the partial results (labs/05_activations.ipynb)")


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
