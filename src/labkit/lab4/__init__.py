"""Lab 4: Gradients: compute fast, drop fast, send as you go.

Chapter ``book/04_gradients.md``; notebook ``labs/04_gradients.ipynb``. This folder is where you write
lab 4's code: each file holds the exercises below, their stubs raising
``NotImplementedError("exercise 4.E: …")`` until you replace them.

    file                   exercise  what you build
    grad_accumulation.py   4.1       gradient accumulation
    bucketed_ddp.py        4.2       bucketed data parallelism overlapping backward
    zero2.py               4.3       ZeRO-2: gradients reduce-scattered as they are ready
    compression.py         4.4       int8, top-K and random-K with error feedback as a DDP comm hook
    powersgd.py            4.5       PowerSGD

Everything outside ``labkit/lab4/`` is the course's toolkit (``labkit.measure``,
``labkit.ranks``, ``labkit.models``, ``labkit.plot``, …): use it, don't edit it. Check an
exercise with ``labkit.check("4.1")``.
"""
from labkit.overlay import solutions_overlay
from labkit.torch_compat import distributed_new_names

distributed_new_names()  # dist.all_gather_single on a torch older than 2.13 (Colab's)

solutions_overlay(__path__, "lab4")
