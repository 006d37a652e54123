"""Lab 6: The system view.

Chapter ``book/06_system.md``; notebook ``labs/06_system.ipynb``. This folder is where you write
lab 6's code: each file holds the exercises below, their stubs raising
``NotImplementedError("exercise 6.E: …")`` until you replace them.

    file                   exercise  what you build
    caching_allocator.py   6.1       a simulator of PyTorch's CUDA caching allocator
    memory_planner.py      6.2       a static memory planner
    device_mesh.py         6.3       a device mesh: ranks, coordinates, groups
    parallel_memory.py     6.4       per-GPU memory of 3D parallelism + ZeRO
    fusion.py              6.5       a fused operator that saves one tensor
    expert_parallel.py     6.6       expert parallelism: dispatch and combine by all-to-all

Everything outside ``labkit/lab6/`` is the course's toolkit (``labkit.measure``,
``labkit.ranks``, ``labkit.models``, ``labkit.plot``, …): use it, don't edit it. Check an
exercise with ``labkit.check("6.1")``.
"""
from labkit.overlay import solutions_overlay

solutions_overlay(__path__, "lab6")
