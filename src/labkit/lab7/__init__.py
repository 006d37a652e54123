"""Lab 7: The panorama: save, split, drop.

Chapter ``book/07_panorama.md``; notebook ``labs/07_panorama.ipynb``. This folder is where you write
lab 7's code: each file holds the exercises below, their stubs raising
``NotImplementedError("exercise 7.E: …")`` until you replace them.

    file                   exercise  what you build
    planner.py             7.1       the planner's search: the fastest configuration that fits
    run_plan.py            7.2       the plan run on real ranks (uses your earlier labs' code)

Everything outside ``labkit/lab7/`` is the course's toolkit (``labkit.measure``,
``labkit.ranks``, ``labkit.models``, ``labkit.plot``, ``labkit.cost_model`` — what a
configuration costs, which the planner searches with — …): use it, don't edit it. Check an
exercise with ``labkit.check("7.1")``.

The capstone: ``run_plan`` builds on your code of labs 1, 2, 3 and 6 (it says which
exercise is still a stub). It is the only lab package that imports another lab's.
"""
from labkit.overlay import solutions_overlay

solutions_overlay(__path__, "lab7")
