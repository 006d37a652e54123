"""Lab 5: Activations: recompute, move out, cut.

Chapter ``book/05_activations.md``; notebook ``labs/05_activations.ipynb``. This folder is where you write
lab 5's code: each file holds the exercises below, their stubs raising
``NotImplementedError("exercise 5.E: …")`` until you replace them.

    file                   exercise  what you build
    checkpointing.py       5.1–5.3   √L and optimal checkpointing schedules and their runner
    selective_checkpoint.py 5.4       selective recompute by FLOPs per byte
    offload.py             5.5       activation offloading through saved-tensor hooks
    flash_attention.py     5.6       FlashAttention's tiled forward and backward
    ring_attention.py      5.7       ring attention (and its zigzag layout)
    sequence_parallel.py   5.8       Megatron sequence parallelism
    chunked_cross_entropy.py 5.9     the loss over a large vocabulary, chunk by chunk

Everything outside ``labkit/lab5/`` is the course's toolkit (``labkit.measure``,
``labkit.ranks``, ``labkit.models``, ``labkit.plot``, …): use it, don't edit it. Check an
exercise with ``labkit.check("5.1")``.
"""
from labkit.overlay import solutions_overlay
from labkit.torch_compat import distributed_new_names, selective_checkpoint_op_output

selective_checkpoint_op_output()  # ctx.op_output for 5.4's policy on an older torch (Colab's)
distributed_new_names()  # 5.8: dist.all_gather_single on a torch older than 2.13 (Colab's)
solutions_overlay(__path__, "lab5")
