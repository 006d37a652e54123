"""Launch N real ``torch.distributed`` ranks from a notebook or a test, and get their results back.

Every distributed lab (data parallel, ZeRO, FSDP, tensor and pipeline parallel) runs its code on
real process groups: ``launch(fn, 4)`` starts 4 processes, each joins one gloo group over TCP on
127.0.0.1 and calls ``fn(rank, world_size, ...)``; the parent gets back each rank's return value
in rank order. gloo runs on CPU everywhere, including a single-GPU Colab where NCCL refuses two
ranks on one GPU; the same ``fn`` runs under ``torchrun`` with NCCL on a real cluster.

Mechanism, and the choices behind it:

- **fork, not spawn, when it is safe.** A forked child starts as a copy of the parent, torch
  already imported and ``fn`` already defined (even in a notebook cell), so a launch costs
  ~0.1-0.6 s; a spawned child starts a fresh interpreter and imports torch again (4-11 s) and
  can only run functions it can import by name. A forked child cannot use CUDA once the parent
  has touched the driver (``torch.cuda.is_available()`` is enough: every lab calls it through
  ``default_device()``), so ``launch`` does not fork whenever the ranks may use CUDA: CUDA
  already initialised here, ``backend="nccl"``, a ``device`` keyword argument that names CUDA,
  or a CUDA tensor or module among the arguments (see :func:`start_method_for`).
- **forkserver, not spawn, when fork is unsafe.** Then the ranks are forked from a *zygote*:
  one clean process (multiprocessing's forkserver) that imported torch once and never touches
  CUDA, started on the first such launch and kept until this process ends (it is restarted if
  ``os.environ`` changes, since its children inherit its environment). Each rank still starts
  as a new process, imports ``fn``'s module fresh (an edit to labkit is always seen: the zygote
  holds torch only, never the course's code) and can use CUDA; it costs what a fork costs,
  not a fresh interpreter's import of torch (see ``tools/launch_cost.py`` for the figures).
  ``start_method="spawn"`` still gives a fresh interpreter per rank.
- **A function is sent by name, as its module defines it now.** Under forkserver and spawn a
  rank imports ``fn`` (and any function or class among the arguments) by module and qualified
  name. After IPython's ``%autoreload 2`` has reloaded an edited module, a name imported before
  the edit still points at the old object, which ``pickle`` refuses ("it's not the same object
  as ..."); ``launch`` looks each one up again in its module and sends the current definition.
- **Arguments by value, always.** A forked child works on a copy-on-write copy of the parent's
  memory. A spawned child receives its arguments through a pipe, and multiprocessing's pickler,
  as torch extends it, would move CPU tensors into shared memory: every rank would then train
  the parent's own model in place. So under spawn ``launch`` pickles ``(args, kwargs)`` to bytes
  with the plain pickler in the parent and unpickles them in the child: each rank gets its own
  copy, as under fork, and no change made by a rank reaches the parent.
- **Inside torchrun**, ``launch`` starts nothing: when the process already belongs to a
  process group of ``world_size`` ranks (``torchrun`` set ``RANK``/``WORLD_SIZE`` and the group
  exists), it runs ``fn(rank, world_size, ...)`` here and returns ``[this rank's result]``; see
  :mod:`labkit.cluster`.
- **``torch.set_num_threads(1)`` first, in every child.** The parent's intra-op thread pool
  does not exist in the forked child, and a child that enters a parallel region before resizing
  the pool can hang; N ranks of many threads each would also oversubscribe the cores.
- **The caller never hangs.** The process group gets a timeout a little under ``timeout`` (a
  rank stuck in a collective gives up by itself), the parent waits with an outer deadline, and
  on any exit (result, error, deadline, Ctrl-C) it kills each child's whole process group.
  A failing rank's traceback is re-raised in the parent as :class:`RankError`; at the deadline
  the parent prints where the unfinished ranks were stuck and raises :class:`RankTimeout`,
  naming only the ranks still inside ``fn``: each rank sends its result *before* the closing
  barrier, so a rank that returned and waits there for a slow peer is never the one blamed.
- **Collectives never run in the parent.** A mismatched collective can abort the process that
  runs it; here that is a child, never the notebook kernel or the pytest process.

Count a rank's communication with :func:`count_comm` (from :mod:`labkit.comm_count`).

The package, one concern a module (the public names are importable from ``labkit.ranks``):
``launcher`` (``launch`` itself), ``checks`` (bad input refused before any process starts),
``methods`` (start methods, the zygote, sending functions and arguments by value), ``rank`` (the
child's side), ``collect`` (waiting for reports, blaming the right rank, killing the rest),
``errors`` (``RankError``, ``RankTimeout``).
Used in: every distributed chapter of ``book/`` and its lab in ``labs/``.
"""
from __future__ import annotations

from labkit.comm_count import CommCounts, count_comm
from labkit.ranks.checks import MAX_WORLD_SIZE
from labkit.ranks.errors import RankError, RankTimeout
from labkit.ranks.launcher import launch
from labkit.ranks.methods import start_method_for

# What the course's tools and tests use from here besides the public names (the rest of each
# module is imported from the module itself, e.g. ``labkit.ranks.methods``):
from labkit.ranks.launcher import reserved_port as reserved_port  # tools/bench, tests/test_two_nodes.py
from labkit.ranks.methods import _default_start_method as _default_start_method  # tests/test_ranks.py
from labkit.ranks.methods import _zygote_pid as _zygote_pid  # tools/launch_cost.py, tests/notebooks

__all__ = ["launch", "start_method_for", "RankError", "RankTimeout", "count_comm", "CommCounts", "MAX_WORLD_SIZE"]
