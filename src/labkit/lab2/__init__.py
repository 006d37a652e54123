"""Lab 2: Optimizer states: don't store, store less, store apart.

Chapter ``book/02_optimizer_states.md``; notebook ``labs/02_optimizer_states.ipynb``. This folder is where you write
lab 2's code: each file holds the exercises below, their stubs raising
``NotImplementedError("exercise 2.E: …")`` until you replace them.

    file                   exercise  what you build
    adafactor.py           2.1       Adafactor's factored second moment
    quantize8bit.py        2.2       block-wise 8-bit quantization with a dynamic code
    adam8bit.py            2.3       8-bit Adam on those codes
    lomo.py                2.4       LOMO: the update fused into backward
    zero1.py               2.5       ZeRO-1: optimizer states sharded over real ranks
    zero_offload.py        2.6       ZeRO-Offload: the optimizer step on the host
    nvme_offload.py        2.7       optimizer states streamed from disk
    came.py                2.8       CAME: confidence-guided factored moments

Everything outside ``labkit/lab2/`` is the course's toolkit (``labkit.measure``,
``labkit.ranks``, ``labkit.models``, ``labkit.plot``, …): use it, don't edit it. Check an
exercise with ``labkit.check("2.1")``.
"""
from labkit.overlay import solutions_overlay

solutions_overlay(__path__, "lab2")
