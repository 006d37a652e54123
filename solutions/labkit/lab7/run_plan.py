"""Run a parallel plan for real: the course GPT on D × P × T gloo ranks, built from the course's pieces.

A *plan* says how ``world_size = D · P · T`` ranks share one training step: D data-parallel
replicas (each trains on B/D of the batch; their gradients are averaged), P pipeline stages (each
holds n_layer/P consecutive blocks; the batch runs through them in M micro-batches under a 1F1B or
GPipe schedule) and T tensor-parallel shards (each keeps 1/T of every block's matrices). On top,
ZeRO shards the optimizer states (stage 1), the gradients (2) or the parameters too (3) over the D
replicas, and activation checkpointing recomputes every block in backward. Nothing here is new:

* the ranks are laid out as the device mesh of exercise 6.3 in the course's order
  (``labkit.lab6.device_mesh.AXES``: pipeline outermost, tensor-parallel innermost), shape
  (P, D, T);
* tensor parallelism is exercise 3.4 (``labkit.lab3.tensor_parallel``), the pipeline exercises 3.5 and
  3.6 (``labkit.lab3.pipeline_schedule``, ``labkit.lab3.pipeline``), ZeRO-1/2/3 exercises 2.5, 4.3 and 3.7
  (``labkit.lab2.zero1``, ``labkit.lab4.zero2``, ``labkit.lab3.zero3``), checkpointing exercise 5.2
  (``labkit.lab5.checkpointing``);
* the memory prediction is chapter 6's (``labkit.lab6.parallel_memory``, exercise 6.4) with the lab
  model's exact activations (``labkit.lab1.accounting``, exercise 1.3).

What composing them adds is small but easy to get wrong: which group each piece gets; that the
replicas' gradients are averaged (by ZeRO's reduce-scatter, or by an all-reduce over the
data-parallel group without ZeRO); that a pipeline cuts the tied embedding / output weight in two
(stage 0's ``wte``, the last stage's ``lm_head``), whose gradients must be summed across the two
stages before the update, as Megatron-LM does over its "embedding group".

Known limits of the prediction (measured on the lab's model, batch 16, 3 steps; a gap is
measured / predicted − 1): within 6% of MemTracker's peak on every rank of the three lab plans,
of DP 2 × TP 2 under ZeRO-2, of DP 2 × PP 2 (GPipe M = 4, 1F1B M = 4), of PP 2 × TP 2 (1F1B
M = 2 and 4, GPipe M = 4), of PP 4 (1F1B and GPipe, M = 4 and 8) and of DP 2 × PP 2 × TP 2 on 8
ranks. Every pipeline stage is within +4.0%; the largest gaps are ZeRO-3's −5.1% and ZeRO-2's
+5.4%. Those are peaks as ``labkit.harness.lab7.run_plans_worker`` measures them, with
``labkit.tracker.Tracker``: PyTorch's MemTracker by itself keeps every received activation of a stage
after the first, and its gradient, alive to the end of the process, so that after 3 steps those
stages measured up to +46% (PP 4, 1F1B, M = 8, stage 2) in bytes that nothing in the run itself
holds. What the prediction leaves out: the gradient of the previous micro-batch's input, still
being sent, and the gradients that appear during the first backward (the last stages' +2–4%);
an update-time peak (checkpointing, small batches) moves by up to one flat gradient buffer with
the timing of gloo's worker thread.

Lab 7, exercise 7.2 (labs/07_panorama.ipynb): :func:`check_plan`, :func:`build_rank`,
:func:`train_step` and :func:`predict_peak`. ``labkit.harness.lab7.run_plans_worker`` runs them on the ranks and
measures each rank's peak with MemTracker. Chapter 7 (book/07_panorama.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from labkit.models import GPT, GPTConfig

__all__ = ["Plan", "PLANS", "RankSetup", "check_plan", "build_rank", "train_step", "predict_peak",
           "PREREQUISITES", "missing_prerequisites", "replica_losses", "MESH", "mesh_shape"]

# ==== given: the course's code — read it, call it, don't change it ====

ZERO_STAGES = (0, 1, 2, 3)
SCHEDULES = ("1f1b", "gpipe")
MESH = ("pp", "dp", "tp")
"""The mesh's axes, outermost to innermost: the course's order (``labkit.lab6.device_mesh.AXES``)
without context parallelism."""


@dataclass(frozen=True)
class Plan:
    """How the ranks share one training step (all sizes ints ≥ 1)."""

    dp: int = 1
    """D, data-parallel replicas; each trains on batch_size / D sequences."""
    tp: int = 1
    """T, tensor-parallel shards of every block (Megatron: attention by heads, MLP by columns/rows)."""
    pp: int = 1
    """P, pipeline stages of n_layer / P blocks each."""
    zero_stage: int = 0
    """ZeRO over the D replicas: 0 (plain Adam, gradients all-reduced), 1, 2 or 3."""
    checkpointing: bool = False
    """Recompute every block in backward (keep only each block's input)."""
    n_micro: int = 1
    """M, micro-batches per step through the pipeline (1 without a pipeline)."""
    schedule: str = "1f1b"
    """The pipeline schedule: "1f1b" or "gpipe"."""

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def label(self) -> str:
        parts = [f"{name} {size}" for name, size in (("DP", self.dp), ("PP", self.pp), ("TP", self.tp))
                 if size > 1] or ["1 rank"]
        extra = [f"ZeRO-{self.zero_stage}"] if self.zero_stage else []
        extra += [f"{self.schedule.upper()} M={self.n_micro}"] if self.pp > 1 else []
        extra += ["checkpointing"] if self.checkpointing else []
        return " × ".join(parts) + (f" ({', '.join(extra)})" if extra else "")


def mesh_shape(plan: Plan) -> tuple[int, int, int]:
    """The mesh's shape for ``plan``, in the order of ``MESH``: (P, D, T)."""
    return plan.pp, plan.dp, plan.tp


PLANS = {
    "zero3x4": Plan(dp=4, zero_stage=3),
    "tp2xdp2": Plan(dp=2, tp=2, zero_stage=0),
    "pp2xdp2": Plan(dp=2, pp=2, zero_stage=1, n_micro=2, schedule="1f1b"),
}
"""The lab's three configurations of 4 ranks: ZeRO-3 over 4 replicas; TP 2 inside, 2 replicas
averaged by an all-reduce (plain Adam); 2 pipeline stages (1F1B, 2 micro-batches) inside, 2
replicas with ZeRO-1."""

PREREQUISITES = {
    "labkit.lab6.device_mesh": "6.3", "labkit.lab3.tensor_parallel": "3.4", "labkit.lab3.pipeline_schedule": "3.5",
    "labkit.lab3.pipeline": "3.6", "labkit.lab2.zero1": "2.5", "labkit.lab4.zero2": "4.3", "labkit.lab3.zero3": "3.7",
    "labkit.lab5.checkpointing": "5.2", "labkit.lab6.parallel_memory": "6.4", "labkit.lab1.accounting": "1.3",
}
"""The exercise behind each module exercise 7.2 builds on."""


@dataclass
class RankSetup:
    """What one rank holds for a plan (made by :func:`build_rank`).

    Attributes:
        plan: the plan.
        rank: this rank in the default group.
        coords: this rank's place in the mesh, ``{"pp": p, "dp": d, "tp": t}``.
        groups: the process group of this rank along each axis (``"dp"``, ``"pp"``, ``"tp"``),
            and ``"embedding"``: the group of the first and last stage of this rank's pipeline
            (None without a pipeline, or on a middle stage).
        module: what this rank runs: the GPT (its blocks tensor-parallel when T > 1, checkpointed
            when asked), or with P > 1 its ``labkit.lab3.pipeline.GPTStage``.
        optimizer: has ``step()`` and ``zero_grad()``: ``torch.optim.Adam`` (ZeRO-0), ``labkit.lab2.zero1.ZeRO1``,
            ``labkit.lab4.zero2.ZeRO2Adam`` or ``labkit.lab3.zero3.ZeRO3``, over the data-parallel group.
        actions: with P > 1, this stage's schedule (a list of ("F" | "B", m)); else None.
    """

    plan: Plan
    rank: int
    coords: dict
    groups: dict
    module: nn.Module
    optimizer: object
    actions: list | None = None
    extra: dict = field(default_factory=dict)


# ==== exercise 7.2: your code ====

def check_plan(plan: Plan, cfg: GPTConfig, batch_size: int, world_size: int) -> None:
    """Refuse a plan these ranks cannot run, before any work: ValueError naming the argument.

    Checks: ``plan`` is a :class:`Plan`; its sizes are ints ≥ 1 whose product D·P·T equals
    ``world_size``; T divides ``cfg.n_head``; P divides ``cfg.n_layer`` (so P ≤ n_layer); D·M
    divides ``batch_size`` (every replica gets equal micro-batches); ``zero_stage`` in 0..3;
    ZeRO-3 only without TP and PP, ZeRO-2 only without PP (their hooks expect the whole model);
    checkpointing only without PP; ``n_micro`` is 1 without a pipeline; ``schedule`` is one of
    ``"1f1b"``, ``"gpipe"``. The message names the field (``plan.tp``, ``batch_size``, ...) and
    what is allowed.
    """
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a labkit.models.GPTConfig, got {type(cfg).__name__}")
    # BEGIN SOLUTION 7.2: refuse every plan the docstring lists, naming the field and what is allowed
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a labkit.lab7.run_plan.Plan, got {type(plan).__name__}")
    for name in ("dp", "tp", "pp", "n_micro"):
        value = getattr(plan, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan.{name} must be an int >= 1, got {value!r}")
    for name, value in (("batch_size", batch_size), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if plan.world_size != world_size:
        raise ValueError(f"plan.dp·plan.pp·plan.tp = {plan.dp}·{plan.pp}·{plan.tp} = "
                         f"{plan.world_size} must equal world_size = {world_size}")
    if cfg.n_head % plan.tp:
        raise ValueError(f"plan.tp = {plan.tp} must divide cfg.n_head = {cfg.n_head} "
                         "(each tensor-parallel rank keeps whole heads)")
    if cfg.n_layer % plan.pp:
        raise ValueError(f"plan.pp = {plan.pp} must divide cfg.n_layer = {cfg.n_layer} "
                         f"(P ≤ n_layer, equal stages)")
    if batch_size % (plan.dp * plan.n_micro):
        raise ValueError(f"plan.dp·plan.n_micro = {plan.dp * plan.n_micro} must divide "
                         f"batch_size = {batch_size} (equal micro-batches on every replica)")
    if plan.zero_stage not in ZERO_STAGES:
        raise ValueError(f"plan.zero_stage must be one of {ZERO_STAGES}, got {plan.zero_stage!r}")
    if plan.zero_stage == 3 and (plan.tp > 1 or plan.pp > 1):
        raise ValueError("plan.zero_stage = 3 runs without tensor or pipeline parallelism "
                         "(plan.tp = plan.pp = 1)")
    if plan.zero_stage == 2 and plan.pp > 1:
        raise ValueError("plan.zero_stage = 2 runs without a pipeline (plan.pp = 1)")
    if not isinstance(plan.checkpointing, bool):
        raise ValueError(f"plan.checkpointing must be a bool, got {plan.checkpointing!r}")
    if plan.checkpointing and plan.pp > 1:
        raise ValueError("plan.checkpointing runs without a pipeline (plan.pp = 1)")
    if plan.pp == 1 and plan.n_micro != 1:
        raise ValueError(f"plan.n_micro must be 1 without a pipeline, got {plan.n_micro}")
    if plan.schedule not in SCHEDULES:
        raise ValueError(f"plan.schedule must be one of {SCHEDULES}, got {plan.schedule!r}")
    # END SOLUTION


def build_rank(plan: Plan, model: GPT, rank: int) -> RankSetup:
    """Build this rank's part of ``plan`` from ``model`` (the same initial GPT on every rank).

    Every rank calls it with the same plan, in the same order (process groups are created
    collectively). Guarantees: ``coords`` and ``groups`` follow the device mesh of shape
    (P, D, T), axes ("pp", "dp", "tp") (``MESH``); with T > 1 every block's attention and MLP are the
    tensor-parallel ones over the "tp" group; with P > 1 ``module`` is stage p of the model cut
    into P stages, ``actions`` that stage's ``plan.schedule`` over ``plan.n_micro``
    micro-batches, and ``groups["embedding"]`` holds the first and last stage of this pipeline
    (the two copies of the tied weight); with checkpointing every block is recomputed; the
    optimizer is Adam (lr 1e-3, as ``torch.optim.Adam``) sharded by ``plan.zero_stage`` over the
    "dp" group. ``model`` may be changed in place.
    """
    # BEGIN SOLUTION 7.2: groups from the mesh; TP, pipeline stage, checkpointing, then the optimizer over the dp group
    from labkit.lab5.checkpointing import Schedule, apply_schedule
    from labkit.lab6.device_mesh import axis_groups, build_process_groups, coords_of
    from labkit.lab3.pipeline import split_gpt
    from labkit.lab3.pipeline_schedule import make_schedule
    from labkit.lab3.tensor_parallel import TPAttention, TPMLP

    shape, names = mesh_shape(plan), MESH
    coords = dict(zip(names, coords_of(rank, shape)))
    groups = build_process_groups(shape, names)
    groups["embedding"] = None
    if plan.pp > 1:  # every rank creates every pipeline's embedding group, in the same order
        for ranks in axis_groups(shape, names, "pp"):
            group = dist.new_group([ranks[0], ranks[-1]])
            if rank in (ranks[0], ranks[-1]):
                groups["embedding"] = group
    module, actions = model, None
    if plan.pp > 1:  # cut first: a stage is a deep copy, and process groups cannot be copied
        module = split_gpt(model, plan.pp)[coords["pp"]]
        actions = make_schedule(plan.schedule, plan.pp, plan.n_micro)[coords["pp"]]
    if plan.tp > 1:
        blocks = module.h.values() if isinstance(module.h, nn.ModuleDict) else module.h
        for block in blocks:
            block.attn = TPAttention(block.attn, groups["tp"])
            block.mlp = TPMLP(block.mlp, groups["tp"])
    if plan.checkpointing:
        apply_schedule(module, Schedule.every_layer(len(module.h)))
    dp = groups["dp"]
    if plan.zero_stage == 0:
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    elif plan.zero_stage == 1:
        from labkit.lab2.zero1 import ZeRO1
        optimizer = ZeRO1(list(module.parameters()), torch.optim.Adam, group=dp, lr=1e-3)
    elif plan.zero_stage == 2:
        from labkit.lab4.zero2 import ZeRO2Adam
        optimizer = ZeRO2Adam(module.parameters(), lr=1e-3, group=dp)
    else:
        from labkit.lab3.zero3 import ZeRO3
        optimizer = ZeRO3(module, lr=1e-3, group=dp)
    return RankSetup(plan, rank, coords, groups, module, optimizer, actions)
    # END SOLUTION


def train_step(setup: RankSetup, x: torch.Tensor, y: torch.Tensor) -> float | None:
    """One training step of the plan on this rank; every rank calls it with the same batch.

    ``x``, ``y``: the step's whole batch, (batch_size, seq_len) token ids and targets. This rank's
    replica (``coords["dp"] = d``) trains on sequences [d·B/D, (d+1)·B/D). Guarantees: after
    the call, every parameter equals what one device running ``torch.optim.Adam`` on the whole
    batch's mean loss holds (to rounding; on this rank's share of it); no full gradient is left
    (``.grad`` None).

    Returns this replica's mean loss (a float) on the ranks that compute it (every rank without a
    pipeline, its last stage with one), None on the other ranks.
    """
    # BEGIN SOLUTION 7.2: this replica's slice; forward and backward (through the pipeline if any); sum the tied weight's two gradients; average over the replicas unless ZeRO does; step
    from labkit.lab3.pipeline import run_stage

    plan, module = setup.plan, setup.module
    b = x.shape[0] // plan.dp
    d = setup.coords["dp"]
    x, y = x[d * b:(d + 1) * b], y[d * b:(d + 1) * b]
    if plan.pp == 1:
        loss = module(x, y)
        loss.backward()
    else:
        inputs = [t.clone() for t in x.chunk(plan.n_micro)]
        targets = [t.clone() for t in y.chunk(plan.n_micro)]
        loss = run_stage(module, setup.actions, inputs, targets, rank=setup.coords["pp"],
                         world_size=plan.pp, group=setup.groups["pp"])
        if setup.groups["embedding"] is not None:  # stage 0's wte and the last stage's lm_head
            tied = module.wte.weight if module.is_first else module.lm_head.weight
            dist.all_reduce(tied.grad, group=setup.groups["embedding"])
    if plan.zero_stage == 0 and plan.dp > 1:
        for p in module.parameters():
            if p.grad is not None:
                p.grad /= plan.dp
                dist.all_reduce(p.grad, group=setup.groups["dp"])
    setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return None if loss is None else float(loss.detach())
    # END SOLUTION


def predict_peak(plan: Plan, cfg: GPTConfig, batch_size: int, rank: int) -> int:
    """The most bytes ``rank`` holds at once in a training step of ``plan`` (from the second step
    on, when Adam's states exist): a batch of ``batch_size`` sequences of ``cfg.block_size``
    tokens, fp32 everywhere, Adam. The largest of three moments (exercise 1.5 did this for one
    device):

    * **backward begins**: this rank's parameters and optimizer states
      (``labkit.lab6.parallel_memory.static_bytes`` of the parameters this rank holds — its blocks'
      share under TP, the embeddings on the first stage, ``ln_f`` and the head on the last —
      sharded by ZeRO over the D replicas; fp32 parameters are their own master, so ZeRO-1
      keeps no copy of its slice); plus, for each micro-batch in flight on this rank (of b =
      B/(D·M) sequences), what it keeps until its backward: its blocks' activations (exercise
      1.3's exact count per block, ``labkit.lab1.accounting.activation_bytes``, with what TP
      splits divided by T — a stage's received input is its first block's input, already in
      that count; with checkpointing, each block's input and one block recomputed), the head's
      on the last stage, and on any other pipeline stage its output (b·s·h·4 bytes); plus, once
      however many micro-batches are in flight, the working set of the backward that begins:
      on the last stage (the only one without a pipeline) the gradients of the log-probabilities
      and logits, 2·b·s·V·4 bytes, on another stage a block's, (2 + 4/T)·b·s·h·4 bytes; with
      ZeRO-3 the root unit, one gathered block and its full gradients;
    * **a later backward** (pipeline, M ≥ 2): the same with every gradient of the stage, the
      micro-batches still in flight then (1F1B and GPipe differ here) and, on a stage other
      than the last, the temporary that holds a weight's new gradient until it is added to
      ``.grad``: the largest, a block's 4h × h matrix (its 1/T share), 16·h²/T bytes;
    * **the update**: parameters, gradients (full; the slice under ZeRO-2/3), states, Adam's two
      temporaries of the largest tensor it updates, and ZeRO-1's flat gradient and averaged slice.

    Returns bytes (int), compared with the MemTracker peak of ``labkit.harness.lab7.run_plans_worker``.
    Raises what :func:`check_plan` raises; ``rank`` outside 0..world_size−1 → ValueError.
    """
    check_plan(plan, cfg, batch_size, plan.world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.world_size:
        raise ValueError(f"rank must be an int in 0..{plan.world_size - 1}, got {rank!r}")
    # BEGIN SOLUTION 7.2: this rank's parameters, gradients and states (parallel_memory), its activations in flight (accounting), the largest of the three moments
    from labkit.lab1.accounting import activation_bytes
    from labkit.lab6.device_mesh import coords_of
    from labkit.lab6.parallel_memory import static_bytes

    D, P, T, M = plan.dp, plan.pp, plan.tp, plan.n_micro
    stage, _, _ = coords_of(rank, mesh_shape(plan))
    first, last = stage == 0, stage == P - 1
    C, V, S, L = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.n_layer
    layers = L // P
    # parameters this rank holds: its blocks' share under TP (biases of row-parallel layers and
    # LayerNorms whole), the embeddings on the first stage, ln_f (and lm_head's copy) on the last
    block = (12 * C * C + 7 * C) // T + 6 * C
    numel = layers * block + (V * C + S * C if first else 0) + (2 * C if last else 0) \
        + (V * C if last and P > 1 else 0)
    static = static_bytes(numel, world_size=D, dp=D, zero_stage=plan.zero_stage, recipe="fp32")
    shard = 4 * math.ceil(numel / D)  # bytes of one fp32 value per owned element
    params, grads, states = static["parameters"], static["gradients"], static["optimizer states"]
    # activations: lab 1's exact count, per block and for the head, for one micro-batch; what
    # tensor parallelism splits (q, k, v, attention scores and output, the MLP's 4C) is 1/T
    b = batch_size // (D * M)
    one = activation_bytes(GPTConfig(**{**cfg.__dict__, "n_layer": 1}), b, S)
    per_block = activation_bytes(GPTConfig(**{**cfg.__dict__, "n_layer": 2}), b, S) - one
    head = one - per_block
    split = 4 * (12 * b * S * C + cfg.n_head * b * S * S)
    per_block -= split - split // T
    # micro-batches whose activations this stage holds at its first backward, and at the later
    # ones (when the earlier micro-batches' gradients have accumulated)
    if P == 1:
        first_in_flight, later_in_flight = 1, 0
    elif plan.schedule == "gpipe":
        first_in_flight, later_in_flight = M, M - 1
    else:
        first_in_flight = min(P - stage, M)
        later_in_flight = min(first_in_flight, M - 1)
    one_micro = layers * per_block
    if plan.checkpointing:  # each block keeps its input; one block is recomputed at a time
        one_micro = layers * 4 * b * S * C + per_block
    if last:
        one_micro += head
    else:
        one_micro += 4 * b * S * C  # the stage's output, kept until its backward
    # what one backward works with, once however many micro-batches are in flight: the last
    # stage's begins with the loss (the gradients of the log-probabilities and logits); another
    # stage's inside a block (the gradient of its output, of the residual branch and of the
    # MLP's 4C-wide hidden activation)
    working = 2 * 4 * b * S * V if last else 4 * b * S * C * (2 + 4 // T)
    backward_begins = params + states + first_in_flight * one_micro + working
    if plan.zero_stage == 3:  # the root stays gathered; one block gathered, with its gradients
        backward_begins += 4 * (V * C + S * C + 2 * C) + 2 * 4 * block
    # a later backward: every gradient of the stage is alive, and inside a block (not on the
    # last stage, where it begins with the loss) each weight's new gradient is a temporary until
    # it is added to .grad: the largest, a 4C × C matrix's share
    accumulating = 0 if last else 4 * 4 * C * C // T
    later_backward = params + states + 4 * numel + accumulating + later_in_flight * one_micro \
        + working if M > 1 else 0
    # the update: every gradient (ZeRO-2/3: the slice) and the optimizer's working memory
    largest = 4 * max(V * C, S * C, 4 * C * C // T) if plan.zero_stage == 0 else shard
    update = params + grads + states + 2 * largest
    if plan.zero_stage == 1:  # the flat gradient and the averaged slice
        update += 4 * D * math.ceil(numel / D) + shard
    return int(max(backward_begins, later_backward, update))
    # END SOLUTION


# ==== given: the course's code — read it, call it, don't change it ====

def missing_prerequisites() -> list[str]:
    """The exercises 7.2 builds on whose module still holds a stub of them, e.g.
    ``["3.7 (labkit.lab3.zero3)"]``; empty when all are written (whether they pass is for
    ``labkit.check``)."""
    import importlib
    import inspect

    missing = []
    for name, exercise in PREREQUISITES.items():
        source = inspect.getsource(importlib.import_module(name))
        if f'raise NotImplementedError("exercise {exercise}:' in source:
            missing.append(f"{exercise} ({name})")
    return missing


def replica_losses(results: list[dict]) -> list[float]:
    """Per step, the mean over the data-parallel replicas of the loss their ranks report: the
    whole batch's mean loss (``results``: one plan's per-rank results of the worker). Results
    in which no rank reports a loss: ValueError."""
    replicas = {}
    for r in results:
        if r["losses"] and r["losses"][0] is not None:
            replicas.setdefault(r["coords"]["dp"], r["losses"])
    if not replicas:
        raise ValueError("results must be one plan's per-rank results of the worker (dicts with "
                         "'losses' and 'coords'), at least one rank reporting losses; got "
                         f"{len(results)} result(s) without any")
    steps = len(next(iter(replicas.values())))
    return [sum(ls[s] for ls in replicas.values()) / len(replicas) for s in range(steps)]
