"""Per exercise, the library code it rebuilds: its reference in the tests, refused while it is graded.

:data:`REBUILDS` gives, per exercise, the reference and a few ``fnmatch`` patterns for both walls:
a name in the student's code that matches (an imported name, a module on an attribute's path, the
attribute itself) is the ``shortcut`` flag (:mod:`labkit.grade.flags`); an operator whose name
(``aten::gelu``) or namespace (``bitsandbytes``) matches is refused at the dispatcher while the
exercise's tests run with student code on the stack, however spelled (:mod:`labkit.grade.child`).
Not here, because a solution uses it: 5.2's ``checkpoint`` per segment, 5.7's per-block flash
kernel, 3.3's ``_scaled_mm``, 3.1's unscale kernel, 3.2's ``_fused_adam_``, 2.6's host-side Adam.
"""
from __future__ import annotations

import fnmatch

ADAM = ("[Aa]dam", "[Aa]dam[Ww]", "_fused_adam*")
ZERO = ("ZeroRedundancyOptimizer", "fsdp", "fully_shard")
SDPA = ("*scaled_dot_product*", "_flash_attention*", "_efficient_attention*", "*[Mm]ulti*[Hh]ead*",
        "flex_attention")
PIPELINING = "torch.distributed.pipelining", ("pipelining",)
CHECKPOINT_SEQUENTIAL = "checkpoint_sequential", ("checkpoint_sequential",)
COMM_HOOKS = "DDP's comm hooks (PowerSGD's too)", ("ddp_comm_hooks",)
AUTOGRAD_COLLECTIVES = ("distributed.nn", "distributed.tensor")  # differentiable collectives:
# torch.distributed.nn's, and DTensor's redistribute (what tensor.parallel builds on)
LAB1 = ("memory_model", "cost_model", "allocation_trace", "measure")  # the course's models and
# measurements, which compute lab 1's answers

REBUILDS: dict[str, tuple[str, tuple[str, ...]]] = {  # exercise -> (its reference, patterns)
    "1.1": ("the built model's own parameter count", ("[Gg][Pp][Tt]", "Block", "CausalSelfAttention",
                                                       "MLP", "*parameters", "n_params",
                                                       "*state_dict*", *LAB1)),
    "1.2": ("the course's memory model and measurements", LAB1),
    "1.3": ("the measured saved activations", ("*saved_tensors*", "save_on_cpu", *LAB1)),
    "1.4": ("the course's memory model and measurements", LAB1),
    "1.5": ("the course's memory model and measurements", LAB1),
    "2.1": ("torch.optim.Adafactor", ("*[Aa]dafactor",)),
    "2.2": ("bitsandbytes' block-wise quantization", ("bitsandbytes",)),
    "2.3": ("bitsandbytes' 8-bit Adam and torch's Adam", ("bitsandbytes", *ADAM)),
    "2.5": ("ZeroRedundancyOptimizer", ZERO),
    "2.7": ("torch's Adam", ADAM),
    "3.1": ("GradScaler and its scale-update kernel", ("*[Gg]rad*[Ss]caler", "_amp_update_scale*")),
    "3.2": ("torch's Adam", ADAM[:2]),
    "3.4": ("torch.distributed.tensor.parallel", ("parallelize_module", "*wiseParallel",
                                                  *AUTOGRAD_COLLECTIVES)),
    "3.5": PIPELINING, "3.6": PIPELINING, "3.8": PIPELINING,
    "3.7": ("FSDP2's fully_shard and torch's Adam", (*ZERO[1:], *ADAM)),
    "4.2": ("DistributedDataParallel", ("DistributedDataParallel", "ddp_comm_hooks", "Reducer")),
    "4.3": ("ZeRO, FSDP, DDP and torch's Adam", (*ZERO, "DistributedDataParallel", *ADAM)),
    "4.4": COMM_HOOKS, "4.5": COMM_HOOKS,
    "5.1": CHECKPOINT_SEQUENTIAL, "5.2": CHECKPOINT_SEQUENTIAL, "5.3": CHECKPOINT_SEQUENTIAL,
    "5.5": ("save_on_cpu", ("save_on_cpu",)),
    "5.6": ("PyTorch's SDPA and flash attention kernels", SDPA),
    "5.7": ("torch's context parallelism", ("context_parallel", *AUTOGRAD_COLLECTIVES)),
    "5.8": ("SequenceParallel", ("parallelize_module", "SequenceParallel", *AUTOGRAD_COLLECTIVES)),
    "6.3": ("DeviceMesh and unravel_index", ("*[Dd]evice*[Mm]esh*", "*ravel*index")),
    "6.4": ("the course's memory models", ("cost_model", "static_bytes_per_gpu", "per_gpu_bytes",
                                            "activation_bytes_per_layer")),
    "6.5": ("PyTorch's gelu kernels", ("gelu*", "GELU")),
    "6.6": ("the single-device MoE layer of the reference", ("moe_reference",)),
}


MEASURING = ("*saved_tensors_hooks", "save_on_cpu", "*DispatchMode", "*FunctionMode",
             "FlopCounterMode", "[Mm]em*[Tt]racker", "*[Dd]isable*[Mm]ode*", "*[Dd]isable[Tt]orch*",
             "Tracker", "peak_bytes", "peak_saved_bytes", "peak_over_calls", "measure_step",
             "count_flops", "saved_activation_bytes")  # (the course's measurements: labkit.measure)
"""What the tests measure with, and a measurement sees only the innermost of: entered in student
code, a shortcut past the measurement in every exercise but those that build one (BUILD_MEASURING);
so are what switches the modes off (``_disable_current_modes``, ``DisableTorchFunction``)."""
BUILD_MEASURING = ("5.5",)  # activation offloading: its own saved-tensor hooks
MEASURED = ("1.3", "2.4", "2.6", "3.2", "3.4", "3.6", "3.7", "4.1", "4.3", "5.1", "5.2", "5.3",
            "5.4", "5.5", "5.6", "5.7", "5.8", "5.9", "6.5", "6.6", "7.2")
"""Exercises whose tests measure torch's work (bytes held, FLOPs, saved tensors; a count of
collectives, 4.4's, numpy cannot dodge): tensor data taken out of torch there is the ``measured
elsewhere`` flag (labkit.grade.flags)."""

STEPS_GIVEN = ("3.7", "4.3")
"""Exercises whose contract steps the course's own torch optimizer (``self.optim``): torch's
optimizers stepped from their code are not refused at run time (their names still are)."""


def matching(exercise: str, *names: str, inside: tuple = ()) -> str | None:
    """The first of ``names`` that a pattern of ``exercise`` matches, or None; a name of
    ``inside`` (where a library's object is defined: ``torch.optim.sparse_adam``) may match
    anywhere in it (``SparseAdam``, ``_FunctionalAdam`` are torch's Adam too), and a dotted
    pattern anywhere in the whole path of ``inside`` (``torch.distributed.nn.functional``)."""
    patterns = REBUILDS.get(exercise, ("", ()))[1] + MEASURING * (exercise not in BUILD_MEASURING)
    return next((n for n in (*names, *inside) if any(fnmatch.fnmatchcase(
        n, f"*{p}*" if n in inside else p) for p in patterns
        if n not in inside or ("." in n) == ("." in p))), None)  # a dotted pattern: a whole path


def reason(exercise: str, name: str) -> str:
    """The message of a refusal: "exercise 5.6 rebuilds PyTorch's SDPA …"."""
    return f"exercise {exercise} rebuilds {REBUILDS[exercise][0]}, its reference in the tests: " \
        f"{name} is refused while it is graded"
