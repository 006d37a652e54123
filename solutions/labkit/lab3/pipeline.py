"""A real pipeline: the course GPT cut into P stages on P ranks, micro-batches sent with send/recv.

Pipeline parallelism (Huang et al. 2019, arXiv 1811.06965; Narayanan et al. 2021, arXiv
2104.04473) keeps on each of P devices only a slice of consecutive layers. A batch is cut into M
micro-batches; stage s receives a micro-batch's activation from stage s−1, runs its layers and
sends the output to stage s+1; in backward it receives the gradient of its output from stage
s+1 and sends the gradient of its input to stage s−1. Which action a stage runs when is the
*schedule* (exercise 3.5): this module's runner executes any given per-stage action list.

A stage must keep each micro-batch's input and output (and the graph autograd saved between
them) from its forward until its backward, so the activations a stage holds are proportional to
the number of micro-batches in flight: M under GPipe, at most P−s under 1F1B.

Lab 3, exercise 3.6 (:func:`run_stage`); :func:`split_gpt` and :func:`check_actions` are given
(``labkit.harness.lab3.pipeline_worker`` runs your ``run_stage`` on ranks for the graders).
Chapter 3 (book/03_parameters.md).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.models import GPT
from labkit.validate import boolean, is_int, positive_int

__all__ = ["GPTStage", "split_gpt", "check_actions", "run_stage"]


# ==== given: the course's code — read it, call it, don't change it ====
class GPTStage(nn.Module):
    """Blocks ``first``..``last−1`` of a GPT; stage 0 also has the embeddings, the last stage
    ``ln_f`` and ``lm_head``. Parameter names are the full model's (``h.2.attn.c_attn.weight``).

    ``n_embd``: the width C of the activations between stages. ``forward(x)``: token ids (B, T) on the first stage, activations (B, T, C) elsewhere;
    returns activations (B, T, C), or logits (B, T, V) on the last stage. Bad arguments (not a
    GPT, blocks outside 0 ≤ first ≤ last ≤ n_layer, flags not bools): TypeError/ValueError
    naming them."""

    def __init__(self, model: GPT, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        if not isinstance(model, GPT):
            raise TypeError(f"model must be a labkit.models.GPT, got {type(model).__name__}")
        n = model.config.n_layer
        if not (is_int(first) and is_int(last) and 0 <= first <= last <= n):
            raise ValueError(f"first, last must be ints with 0 <= first <= last <= n_layer = {n} "
                             f"(the stage holds blocks first..last-1), got first={first!r}, last={last!r}")
        is_first, is_last = boolean("is_first", is_first), boolean("is_last", is_last)
        model = copy.deepcopy(model)
        self.is_first, self.is_last = is_first, is_last
        self.n_embd = model.config.n_embd
        if is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.h = nn.ModuleDict({str(i): model.h[i] for i in range(first, last)})
        if is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.h.values():
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.ln_f(x))
        return x


def split_gpt(model: GPT, num_stages: int) -> list[GPTStage]:
    """Cut ``model`` into ``num_stages`` stages of n_layer / num_stages blocks each (copies).

    The tied embedding / output weight becomes two parameters (``wte.weight`` on stage 0,
    ``lm_head.weight`` on the last stage) when num_stages > 1: its gradient is their sum."""
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a labkit.models.GPT, got {type(model).__name__}")
    n = model.config.n_layer
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1 \
            or n % num_stages:
        raise ValueError(f"num_stages must be an int >= 1 dividing n_layer = {n}, got {num_stages!r}")
    k = n // num_stages
    return [GPTStage(model, s * k, (s + 1) * k, s == 0, s == num_stages - 1)
            for s in range(num_stages)]


def check_actions(actions, num_microbatches: int) -> list[tuple[str, int]]:
    """Validate one stage's action list: each ``("F", m)`` and ``("B", m)`` for m in 0..M−1
    exactly once, every B after its F. Returns the list as ``(kind, m)`` tuples."""
    positive_int("num_microbatches", num_microbatches)
    if not isinstance(actions, (list, tuple)):
        raise ValueError(f"actions must be a list of ('F' | 'B', micro-batch) pairs, got "
                         f"{type(actions).__name__}")
    out, seen = [], set()
    for a in actions:
        if not isinstance(a, (list, tuple)) or len(a) != 2 or a[0] not in ("F", "B") \
                or isinstance(a[1], bool) or not isinstance(a[1], int) \
                or not 0 <= a[1] < num_microbatches:
            raise ValueError(f"actions: each action must be ('F' | 'B', m) with m in "
                             f"0..{num_microbatches - 1}, got {a!r}")
        kind, m = a[0], a[1]
        if (kind, m) in seen or (kind == "B" and ("F", m) not in seen):
            raise ValueError(f"actions: {a!r} repeated, or a backward before its forward")
        seen.add((kind, m))
        out.append((kind, m))
    if len(seen) != 2 * num_microbatches:
        raise ValueError(f"actions must hold F and B of micro-batches 0..{num_microbatches - 1} "
                         f"once each, got {len(seen)} of {2 * num_microbatches}")
    return out


# ==== exercise 3.6: your code ====
def run_stage(stage: nn.Module, actions, inputs: list[torch.Tensor],
              targets: list[torch.Tensor], *, rank: int, world_size: int, group=None):
    """Run one pipeline step of this rank's ``stage``, action by action, over real send/recv.

    Rank r holds stage r of ``world_size``; ``inputs``/``targets`` are the M micro-batches of
    token ids and targets (every rank gets them: rank 0 feeds ``inputs[m]`` to its stage, the
    last rank uses ``targets[m]``, the others only their shapes). For ``("F", m)``: a rank other
    than 0 receives micro-batch m's activation (float32, (b, T, n_embd)) from rank r−1; the stage
    runs; a rank other than the last sends the output to rank r+1, the last rank computes
    loss_m = cross-entropy(logits, targets[m]) / M. For ``("B", m)``: the last rank backpropagates
    loss_m, another rank receives the gradient of its output of m from rank r+1 and
    backpropagates it; a rank other than 0 then sends the gradient of its input to rank r−1.

    Guarantees: the stage's parameters' ``.grad`` accumulate the gradient of the batch's mean
    loss (equal micro-batches); each F and B moves exactly one tensor each way it must; what is
    kept for micro-batch m is released by its backward — its stash, and the send of its
    activation, which has completed once the gradient of that activation has come back (so a
    stage's live memory follows the micro-batches in flight, not M); a send never waits for its
    receiver (both neighbours may be sending at the same time), and all sends have completed on
    return.

    ``group``: the pipeline's process group (None: the default group); ``rank`` and
    ``world_size`` are then this rank's index in it and its size, and neighbours are addressed by
    their index in it (``group_src=`` / ``group_dst=`` of ``dist.recv`` / ``dist.isend``).

    Returns the batch's loss (a 0-dim tensor, sum of the loss_m) on the last rank, None elsewhere.
    """
    if not isinstance(inputs, (list, tuple)) or not inputs or \
            not all(isinstance(t, torch.Tensor) for t in inputs):
        raise ValueError(f"inputs must be a non-empty list of micro-batch tensors, got "
                         f"{type(inputs).__name__} of {len(inputs) if hasattr(inputs, '__len__') else '?'}")
    if not isinstance(targets, (list, tuple)):
        raise ValueError(f"targets must be a list of micro-batch tensors, got {type(targets).__name__}")
    M = len(inputs)
    actions = check_actions(actions, M)
    if len(targets) != M:
        raise ValueError(f"targets must hold M = {M} micro-batches like inputs, got {len(targets)}")
    positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in 0..world_size−1 = {world_size - 1}, got {rank!r}")
    # BEGIN SOLUTION 3.6: execute each action: receive, run, send; keep what backward needs per micro-batch until its backward
    first, last = rank == 0, rank == world_size - 1
    stash, sends, total = {}, {}, None  # sends: the handles still in flight, by ("F" | "B", m)

    def finish(key):  # wait for a send (done or nearly): its tensor is released
        work = sends.pop(key, None)
        if work is not None:
            work.wait()

    previous_grad = None
    for kind, m in actions:
        if kind == "F":
            if first:
                x = inputs[m]
            else:
                b, t = inputs[m].shape
                x = torch.empty(b, t, stage.n_embd)
                dist.recv(x, group=group, group_src=rank - 1)
                x.requires_grad_()
            out = stage(x)
            if last:
                out = F.cross_entropy(out.reshape(-1, out.shape[-1]), targets[m].reshape(-1)) / M
                total = out.detach() if total is None else total + out.detach()
            else:
                sends["F", m] = dist.isend(out.detach(), group=group, group_dst=rank + 1)
            stash[m] = (x, out)
        else:
            x, out = stash.pop(m)
            if last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, group=group, group_src=rank + 1)
                finish(("F", m))  # the next stage used m's activation to make this gradient
                out.backward(grad)
                del grad
            if not first:
                finish(previous_grad)  # stage r−1 takes the gradients in order: that one is done
                sends["B", m] = dist.isend(x.grad, group=group, group_dst=rank - 1)
                previous_grad = ("B", m)
            del x, out
    for key in list(sends):
        finish(key)
    return total
    # END SOLUTION
