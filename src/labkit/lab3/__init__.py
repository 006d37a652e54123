"""Lab 3: Parameters: compute low, store high, shard to share.

Chapter ``book/03_parameters.md``; notebook ``labs/03_parameters.ipynb``. This folder is where you write
lab 3's code: each file holds the exercises below, their stubs raising
``NotImplementedError("exercise 3.E: …")`` until you replace them.

    file                   exercise  what you build
    loss_scaler.py         3.1       a dynamic loss scaler
    mixed_precision.py     3.2       mixed-precision Adam with fp32 master weights
    fp8.py                 3.3       an fp8 linear layer with delayed scaling
    tensor_parallel.py     3.4       Megatron's f and g: tensor-parallel MLP and attention
    pipeline_schedule.py   3.5       GPipe, 1F1B and interleaved schedules
    pipeline.py            3.6       a real pipeline over ranks
    zero3.py               3.7       ZeRO-3: parameters gathered on use, with prefetch
    zero_bubble.py         3.8       zero-bubble pipelines: B/W split, ZB-H1, any placement

Everything outside ``labkit/lab3/`` is the course's toolkit (``labkit.measure``,
``labkit.ranks``, ``labkit.models``, ``labkit.plot``, …): use it, don't edit it.
``labkit.harness.lab3`` runs your code on ranks for the graders and the notebook;
``labkit.reference.lab3`` holds what it is compared with (PyTorch's own implementations). Check an
exercise with ``labkit.check("3.1")``.
"""
from labkit.overlay import solutions_overlay

solutions_overlay(__path__, "lab3")
