"""Run the course's distributed techniques on a real cluster: ``torchrun ... -m labkit.cluster <demo>``.

    torchrun --standalone --nproc-per-node 2 -m labkit.cluster zero1 --steps 3
    torchrun --standalone --nproc-per-node 4 -m labkit.cluster ring_attention --seq 4096
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m labkit.cluster zero1 --n-layer 24 --n-embd 2048

Each rank reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (set by torchrun), joins one process
group (NCCL on CUDA, gloo on CPU; ``--device``), is placed on its local GPU, and runs the demo
through :func:`labkit.ranks.launch`, which inside torchrun runs the function on this existing
group instead of starting processes: the very calls the labs make in a notebook. The exercise
modules are whatever ``labkit`` is installed: in the student edition, the student's own code.

Rank 0 prints one row per rank: the measured bytes next to the chapter's prediction, the bytes
this rank communicated, and the step time, then a line ``json: {...}`` with the same figures
(what the tests compare against an in-process :func:`labkit.ranks.launch` run).

The package, one demo a module (``labkit.cluster.zero1``, ``.zero2``, ``.zero3``,
``.tensor_parallel``, ``.sequence_parallel``, ``.pipeline``, ``.ring_attention``, ``.plan``):
each defines its per-rank ``run`` (a docstring saying what it measures against which
prediction), its table's ``rows``, its ``check`` of the options against the job, and ``DEMO``,
the :class:`~labkit.cluster.common.Demo` that names them with its options dataclass
(:mod:`labkit.cluster.options`). A demo module is imported when its demo runs, so a lab file
that does not import stops only the demos that use it. ``registry`` finds a demo by name,
``common`` holds what the demos share, ``cli`` is the command line (``python -m labkit.cluster
--help``). To add a demo: one module, and its name in ``registry.DEMOS``. Several demos in one
job (``-m labkit.cluster zero1 zero2 zero3``) run one after another with the same options, each
printing its table.

Bad input (an unknown demo, a world size the demo cannot use, ``--device cuda`` without a GPU,
no torchrun) ends with a message and exit status 2 before any collective starts.
"""
from labkit.cluster.common import Demo, UsageError
from labkit.cluster.registry import DEMOS, demo, run_demos, table

__all__ = ["DEMOS", "Demo", "UsageError", "demo", "run_demos", "table"]
