"""The course's cost model of a training run: per-GPU memory and step time of one configuration.

A configuration (``Config``) of a model (``ModelSpec``) on a cluster (``Cluster``) is scored by
``evaluate``: the bytes of each consumer on its busiest GPU (``memory``), whether they fit, and
the seconds of one optimizer step (``step_time``, in ``step``). Chapter 7's planner (exercise 7.1,
``labkit.lab7.planner``) searches configurations with it; the page checks it against published
runs (``labkit.reference.lab7``, tests/test_lab7_calibration.py).

What each module models, with its sources and what it leaves out:

* ``hardware``: the GPUs (datasheets, and the measured matmul ceiling MAMF), links, host.
* ``spec``: the model's shape (dense or a mixture of experts) and one configuration, sequence
  parallelism, interleaving, FSDP without re-sharding after forward and expert parallelism
  among its choices.
* ``memory``: ZeRO's static state (the routed experts split by E), Korthikanti et al.'s
  activations (an MoE layer's by ``labkit.moe_memory``), micro-batches in flight under plain
  and interleaved 1F1B, offload's host bytes.
* ``kernels``: every kernel of a layer on a roofline (GEMMs at the matmul ceiling over their
  wave efficiency, fused attention by key length, memory-bound kernels by bytes).
* ``step``: compute, the bubble, and each axis' traffic (the experts' all-to-all included),
  overlapped where the schedule allows.
* ``space``: the search space's rules and argument checks; ``ranking``: estimates, the planner's
  answer, and the sensitivity box.

Chapter 7 (book/07_panorama.md).
"""
from .hardware import A100_SXM_80GB, FLASH_2_H100, H100_SXM, KNOBS, Cluster, scaled
from .kernels import MicroBatchTime, micro_batch_time
from .memory import host_bytes, kv_heads_per_rank, memory_estimate
from .ranking import (SENSITIVITY, Estimate, PlanResult, evaluate, rank_of_layout, row,
                      sensitivity, terms, why_slower)
from .space import ATTENTION, CHECKPOINTING, DEFAULT_MARGIN, SPACE, check_space, combinations
from .spec import Config, ModelSpec, check_expert_parallel
from .step import AXES, MESH_ORDER, StepTime, step_time

__all__ = ["A100_SXM_80GB", "FLASH_2_H100", "ATTENTION", "AXES", "CHECKPOINTING", "Cluster", "Config",
           "DEFAULT_MARGIN", "Estimate", "H100_SXM", "KNOBS", "MESH_ORDER", "MicroBatchTime",
           "ModelSpec", "PlanResult", "SENSITIVITY", "SPACE", "StepTime",
           "check_expert_parallel", "check_space", "combinations", "evaluate", "host_bytes", "kv_heads_per_rank",
           "memory_estimate", "micro_batch_time", "rank_of_layout", "row", "scaled",
           "sensitivity", "step_time", "terms", "why_slower"]
