"""Lab 1: Where the memory goes: the four consumers.

Chapter ``book/01_where_the_memory_goes.md``; notebook ``labs/01_where_the_memory_goes.ipynb``. This folder is where you write
lab 1's code: each file holds the exercises below, their stubs raising
``NotImplementedError("exercise 1.E: …")`` until you replace them.

    file                   exercise  what you build
    accounting.py          1.1–1.5   count parameters, bytes per consumer, saved activations, the peak, a memory calculator

Everything outside ``labkit/lab1/`` is the course's toolkit (``labkit.measure``,
``labkit.ranks``, ``labkit.models``, ``labkit.plot``, …): use it, don't edit it. Check an
exercise with ``labkit.check("1.1")``.
"""
from labkit.overlay import solutions_overlay

solutions_overlay(__path__, "lab1")
