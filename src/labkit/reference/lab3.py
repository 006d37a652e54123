"""Lab 3's references: PyTorch's own implementations the graders compare the student's code with.

- :func:`run_parallelize_module`: ``torch.distributed.tensor.parallel.parallelize_module``
  (ColwiseParallel / RowwiseParallel) on an MLP, for exercise 3.4;
- :func:`record_torch_schedule`, :func:`torch_interleaved_order`: the actions
  ``torch.distributed.pipelining``'s ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B
  execute, for exercise 3.5;
- :func:`torch_pipeline_worker`: a step of ``torch.distributed.pipelining`` on the GPT cut into
  P stages (cut here, not by the student's ``split_gpt``), for exercise 3.6;
- :func:`train_fsdp2`: FSDP2's ``fully_shard`` + ``torch.optim.Adam``, and :func:`train_adam`:
  plain data-parallel Adam (the mean gradient over the ranks, one device), for exercise 3.7;
- :func:`record_torch_zero_bubble`, :func:`torch_zero_bubble_order`: the F / B (input
  gradient) / W (weight gradient) actions ``ScheduleInterleavedZeroBubble`` and
  ``ScheduleZBVZeroBubble`` execute, and their plans, for exercise 3.8.

Actions come back as plain tuples, ``("F", m)`` or ``("F", m, chunk)``, which compare equal to the
lab's ``Action`` / ``ChunkAction`` named tuples. Nothing here imports a lab package
(tests/test_layout.py): no edit of a student's file can move a reference value.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.comm_count import count_comm
from labkit.models import GPT, GPTConfig
from labkit.validate import one_of

__all__ = ["run_parallelize_module", "record_torch_schedule", "torch_interleaved_order",
           "torch_pipeline_worker", "train_fsdp2", "train_adam", "ZERO_BUBBLE_KINDS",
           "record_torch_zero_bubble", "torch_zero_bubble_order"]


def _counts(c) -> dict:
    return {"calls": dict(c.calls), "bytes": dict(c.bytes_sent)}


# ---------------------------------------------------------------- 3.4 tensor parallelism

def run_parallelize_module(rank: int, world_size: int, mlp: nn.Module, x: torch.Tensor) -> dict:
    """Shard a copy of ``mlp`` with PyTorch's ``parallelize_module`` (c_fc ColwiseParallel,
    c_proj RowwiseParallel) on a CPU DeviceMesh of all ranks; return its output on ``x`` and the
    forward's comm counts. Run by ``labkit.ranks.launch``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    model = parallelize_module(copy.deepcopy(mlp), mesh,
                               {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
    with count_comm() as fwd:
        out = model(x)
        out = out.wait() if hasattr(out, "wait") else out  # an AsyncCollectiveTensor
    dist.barrier()
    return {"out": torch.Tensor(out.detach()).clone(), "forward": _counts(fwd)}


# ---------------------------------------------------------------- 3.5 schedules

class _Tag(torch.autograd.Function):
    """Identity whose backward logs the action: marks where a micro-batch's backward starts."""

    @staticmethod
    def forward(ctx, x, action, log):
        ctx.action, ctx.log = action, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.action)
        return grad, None, None


class _TaggedStage(nn.Module):
    """A stage whose column 0 carries the micro-batch index through the pipeline unchanged;
    ``chunk`` None logs ``(kind, m)``, an int logs ``(kind, m, chunk)``."""

    def __init__(self, width: int, log: list, chunk: int | None = None):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.log, self.chunk = log, chunk

    def _action(self, kind, m):
        return (kind, m) if self.chunk is None else (kind, m, self.chunk)

    def forward(self, x):
        # The micro-batch index rides in column 0. But the first step's metadata inference runs
        # a non-first stage's forward on torch.empty memory (PipelineStage._to_tensor): garbage,
        # sometimes NaN, and int(NaN) raised ("cannot convert float NaN to integer", a flaky
        # grader). That step is not recorded; an index that is not finite is logged as -1.
        v = float(x[0, 0])
        m = int(v) if math.isfinite(v) else -1
        self.log.append(self._action("F", m))
        out = torch.cat([x[:, :1], torch.tanh(self.lin(x[:, 1:]))], dim=1)
        return _Tag.apply(out, self._action("B", m), self.log)


def record_torch_schedule(rank: int, world_size: int, kind: str, num_microbatches: int,
                          width: int = 4, num_chunks: int = 1) -> list[tuple]:
    """Run ``torch.distributed.pipelining``'s ScheduleGPipe ("gpipe"), Schedule1F1B ("1f1b",
    M ≥ P) or ScheduleInterleaved1F1B ("interleaved", ``num_chunks`` stages per rank: virtual
    stages c·P + rank) for a step on ``world_size`` gloo ranks (run by ``labkit.ranks.launch``);
    return the actions this rank executed, in order, as ``(kind, m)`` (``(kind, m, chunk)``)."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    one_of("kind", kind, ("gpipe", "1f1b", "interleaved"))
    torch.manual_seed(rank)
    log: list = []
    loss_fn = lambda out, y: ((out[:, 1:] - y) ** 2).mean()  # noqa: E731
    if kind == "interleaved":
        v = num_chunks
        stages = [PipelineStage(_TaggedStage(width, log, c), c * world_size + rank, v * world_size,
                                torch.device("cpu")) for c in range(v)]
        schedule = ScheduleInterleaved1F1B(stages, num_microbatches, loss_fn=loss_fn)
    else:
        stage = PipelineStage(_TaggedStage(width, log), rank, world_size, torch.device("cpu"))
        cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
        schedule = cls(stage, num_microbatches, loss_fn=loss_fn)
    first, last = rank == 0, rank == world_size - 1  # virtual stage 0 / vP−1 live here
    x = torch.randn(num_microbatches, width + 1)
    x[:, 0] = torch.arange(num_microbatches, dtype=x.dtype)  # row m is micro-batch m
    return _second_step_log(schedule, log, x, torch.zeros(num_microbatches, width), first, last)


def _second_step_log(schedule, log: list, x, y, first: bool, last: bool) -> list:
    """Run two steps of ``schedule`` on this rank (the first stage feeds ``x``, the last takes
    target ``y``) and return what ``log`` recorded in the second: the first step also infers
    shapes, with extra forwards."""
    for _ in range(2):
        log.clear()
        if first and last:
            schedule.step(x, target=y, losses=[])
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
    dist.barrier()  # no rank leaves (and destroys the group) while another sends
    return list(log)


def torch_interleaved_order(num_stages: int, num_microbatches: int, num_chunks: int) -> list[list[tuple]]:
    """``ScheduleInterleaved1F1B.pipeline_order`` (torch's plan, idle slots dropped) as
    ``(kind, m, chunk)`` lists, computed without a process group (for pictures and checks)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    class _Plan(ScheduleInterleaved1F1B):
        def __init__(self, P, M, v):  # only what _calculate_single_rank_operations reads
            self.pp_group_size, self.n_local_stages, self._n_microbatches = P, v, M
            self.number_of_rounds = max(1, M // P)
            self.microbatches_per_round = M // self.number_of_rounds

    plan = _Plan(num_stages, num_microbatches, num_chunks)
    out = []
    for rank in range(num_stages):
        ops = [a for a in plan._calculate_single_rank_operations(rank) if a is not None]
        out.append([("F" if a.computation_type == _ComputationType.FORWARD else "B",
                     a.microbatch_index, a.stage_index // num_stages) for a in ops])
    return out


# ---------------------------------------------------------------- 3.6 a pipeline

class _ReferenceStage(nn.Module):
    """Blocks [first, last) of ``model`` (a copy), the embeddings on stage 0 and ``ln_f`` +
    ``lm_head`` on the last: the cut chapter 3 describes, written here independently of the
    lab's ``split_gpt`` (parameter names are the full model's: ``h.2.attn.c_attn.weight``)."""

    def __init__(self, model: GPT, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        model = copy.deepcopy(model)
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.h = nn.ModuleDict({str(i): model.h[i] for i in range(first, last)})
        if is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x):
        if self.is_first:
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))
        for block in self.h.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.is_last else x


def torch_pipeline_worker(rank: int, world_size: int, cfg: GPTConfig, state: dict, kind: str,
                          x: torch.Tensor, y: torch.Tensor, num_microbatches: int) -> dict:
    """PyTorch's pipeline, run by ``labkit.ranks.launch``: stage ``rank`` of the GPT (n_layer / P
    blocks each) in a ``torch.distributed.pipelining.PipelineStage``, one step of
    ``ScheduleGPipe`` ("gpipe") or ``Schedule1F1B`` ("1f1b") with the micro-batch loss
    cross-entropy (its gradients scaled by 1/M, ``scale_grads``). Returns ``{"loss": the batch's
    mean loss on the last rank (None elsewhere), "grads": {name: grad}}``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    one_of("kind", kind, ("gpipe", "1f1b"))
    model = GPT(cfg)
    model.load_state_dict(state)
    k = cfg.n_layer // world_size
    stage = _ReferenceStage(model, rank * k, (rank + 1) * k, rank == 0, rank == world_size - 1)
    pipe = PipelineStage(stage, rank, world_size, torch.device("cpu"))
    loss_fn = lambda out, t: F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1))  # noqa: E731
    schedule = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(pipe, num_microbatches, loss_fn=loss_fn)
    losses: list = []
    if world_size == 1:
        schedule.step(x, target=y, losses=losses)
    elif rank == 0:
        schedule.step(x)
    elif rank == world_size - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    dist.barrier()  # no rank leaves (and destroys the group) while another sends
    loss = torch.stack(losses).mean().detach() if losses else None
    return {"loss": loss, "grads": {n: p.grad for n, p in stage.named_parameters()}}


# ---------------------------------------------------------------- 3.7 ZeRO-3

def train_fsdp2(rank: int, world_size: int, model: nn.Module, batches, lr: float = 1e-3,
                backwards: int = 1) -> dict:
    """The training of ``labkit.harness.lab3.train_zero3`` with PyTorch's FSDP2: ``fully_shard``
    on each block, then the model; ``torch.optim.Adam`` over the parameters that require a
    gradient. ``backwards`` micro-batches per step: ``batches[step][rank]`` is then a list of
    (x, y). Returns ``{"params", "losses", "shard_bytes", "comm"}``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    losses, comm = [], []
    for step_batches in batches:
        micro = step_batches[rank] if backwards > 1 else [step_batches[rank]]
        with count_comm() as c:
            total = 0.0
            for x, y in micro:
                loss = model(x, y)
                loss.backward()
                total += float(loss.detach())
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / len(micro))
        comm.append(_counts(c))
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    dist.barrier()  # no rank destroys the group while another still gathers
    return {"params": params, "losses": losses, "shard_bytes": shard_bytes, "comm": comm}


def train_adam(model: nn.Module, batches, lr: float = 1e-3, backwards: int = 1) -> list[torch.Tensor]:
    """Data-parallel training computed on one device: per step, the gradient averaged over the
    ranks' batches ``batches[step][r]`` (each rank's loss a mean; ``backwards`` > 1: each rank's
    list of micro-batches, their gradients summed), then ``torch.optim.Adam`` on every parameter
    that requires a gradient. Returns the parameters after the last step (copies)."""
    model = copy.deepcopy(model)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    for step_batches in batches:
        n = len(step_batches)
        for rank_batches in step_batches:
            for x, y in (rank_batches if backwards > 1 else [rank_batches]):
                (model(x, y) / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------- 3.8 zero-bubble schedules

ZERO_BUBBLE_KINDS = ("zb1p", "zbv")
"""``"zb1p"``: ScheduleInterleavedZeroBubble with one stage per rank (ZB-H1); ``"zbv"``:
ScheduleZBVZeroBubble, two stages per rank in a V (rank r holds stages r and 2P−1−r)."""

_SPLIT_KIND = {"F": "F", "I": "B", "W": "W"}  # torch's names -> the lab's (B = input gradient)


def _zero_bubble_stages(rank: int, world_size: int, kind: str) -> list[int]:
    return [rank] if kind == "zb1p" else [rank, 2 * world_size - 1 - rank]


def _recording_stage_class():
    """A ``PipelineStage`` that logs each compute call the schedule's runtime makes on it:
    ("F", m, stage) for ``forward_one_chunk``, ("B", m, stage) for an input-gradient
    ``backward_one_chunk`` (full: ("BW", m, stage)) and ("W", m, stage) for
    ``backward_weight_one_chunk``, then runs torch's own method."""
    from torch.distributed.pipelining import PipelineStage

    class _RecordingStage(PipelineStage):
        def __init__(self, *args, log: list, **kwargs):
            super().__init__(*args, **kwargs)
            self.log = log

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            self.log.append(("F", fwd_chunk_id, self.stage_index))
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            self.log.append(("BW" if full_backward else "B", bwd_chunk_id, self.stage_index))
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            self.log.append(("W", bwd_chunk_id, self.stage_index))
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    return _RecordingStage


def record_torch_zero_bubble(rank: int, world_size: int, kind: str, num_microbatches: int,
                             width: int = 4) -> list[tuple]:
    """Run torch's ``ScheduleInterleavedZeroBubble`` (``kind`` "zb1p": stage ``rank`` on each
    rank) or ``ScheduleZBVZeroBubble`` ("zbv": stages ``rank`` and ``2P−1−rank``) for two steps
    of a small linear pipeline on ``world_size`` gloo ranks (run by ``labkit.ranks.launch``).
    Returns the compute actions this rank's runtime ran in the second step, in order, as
    ``(kind, micro-batch, global stage)`` with kind "F", "B" (torch's input gradient "I") or
    "W" (the first step also infers shapes)."""
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

    one_of("kind", kind, ZERO_BUBBLE_KINDS)
    torch.manual_seed(rank)
    log: list = []
    num_stages = world_size * (1 if kind == "zb1p" else 2)
    stage_cls = _recording_stage_class()
    stages = [stage_cls(nn.Sequential(nn.Linear(width, width), nn.Tanh()), j, num_stages,
                        torch.device("cpu"), log=log)
              for j in _zero_bubble_stages(rank, world_size, kind)]
    loss_fn = lambda out, y: ((out - y) ** 2).mean()  # noqa: E731
    cls = ScheduleInterleavedZeroBubble if kind == "zb1p" else ScheduleZBVZeroBubble
    schedule = cls(stages, num_microbatches, loss_fn=loss_fn)
    here = _zero_bubble_stages(rank, world_size, kind)
    return _second_step_log(schedule, log, torch.randn(num_microbatches, width),
                            torch.zeros(num_microbatches, width), 0 in here, num_stages - 1 in here)


def torch_zero_bubble_order(kind: str, num_stages: int, num_microbatches: int) -> list[list[tuple]]:
    """The plan of ``ScheduleInterleavedZeroBubble`` (one stage per rank, "zb1p") or
    ``ScheduleZBVZeroBubble`` ("zbv") for ``num_stages`` ranks, idle slots dropped, as
    ``(kind, micro-batch, global stage)`` lists with kind "F", "B" (input gradient), "W";
    computed without a process group (for pictures and checks)."""
    from torch.distributed.pipelining.schedules import (ScheduleInterleavedZeroBubble,
                                                         ScheduleZBVZeroBubble)

    one_of("kind", kind, ZERO_BUBBLE_KINDS)
    P, M = num_stages, num_microbatches

    class _ZB1P(ScheduleInterleavedZeroBubble):
        def __init__(self):  # only what _calculate_single_rank_operations reads
            self.pp_group_size, self.n_local_stages, self._n_microbatches = P, 1, M
            self.number_of_rounds = max(1, M // P)
            self.microbatches_per_round = M // self.number_of_rounds

    class _ZBV(ScheduleZBVZeroBubble):
        def __init__(self):
            self.pp_group_size, self._n_microbatches, self.num_stages = P, M, 2 * P

    plan = _ZB1P() if kind == "zb1p" else _ZBV()
    return [[(_SPLIT_KIND[a.computation_type.value], a.microbatch_index, a.stage_index)
             for a in plan._calculate_single_rank_operations(rank) if a is not None]
            for rank in range(P)]
