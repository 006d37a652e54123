"""Per exercise, what it rebuilds: the library code that is its reference, refused while it is graded.

An exercise that rebuilds something PyTorch ships (FlashAttention, GradScaler, Adafactor, DDP…) is
graded against that very implementation. :data:`REBUILDS` gives, per exercise, why and a few
``fnmatch`` patterns, which serve both walls: a name of the student's code that matches (an
imported name, a module on an attribute's path, the attribute itself) is the ``shortcut`` flag
(:mod:`labkit.grade.flags`); an operator whose name (``aten::gelu``) or namespace
(``bitsandbytes``) matches is refused at PyTorch's dispatcher while the exercise's tests run with
student code on the stack, however it was spelled (:mod:`labkit.grade.child`).

What a solution legitimately uses is not here: 5.2's contract requires
``torch.utils.checkpoint.checkpoint``; 5.7 attends each block with
``aten::_scaled_dot_product_flash_attention_for_cpu`` (refused for 5.6 only); 3.3's contract is
"one ``_scaled_mm``"; 3.1 may unscale with ``_amp_foreach_non_finite_check_and_unscale_`` and 3.2
may step with ``_fused_adam_``; 2.6 steps ``torch.optim.Adam`` on the host by design, so Adam is
refused only where the exercise writes the step itself (2.3, 2.7, 3.2, 3.7, 4.3).
"""
from __future__ import annotations

import fnmatch

ADAM = ("[Aa]dam", "[Aa]dam[Ww]", "_fused_adam*")
ZERO = ("ZeroRedundancyOptimizer", "fsdp", "fully_shard")
SDPA = ("*scaled_dot_product*", "_flash_attention*", "_efficient_attention*", "*[Mm]ulti*[Hh]ead*",
        "flex_attention")

REBUILDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "1.1": ("counts the parameters from the config alone: building the model and counting its "
            "tensors is the reference here", ("GPT", "*parameters")),
    "1.3": ("adds up the saved activations op by op: measuring them is the reference here",
            ("saved_tensors_hooks", "[Mm]em*[Tt]racker", "measure")),
    "2.1": ("writes Adafactor's step itself: torch.optim.Adafactor is the reference here",
            ("*[Aa]dafactor",)),
    "2.2": ("quantizes block-wise itself: bitsandbytes' kernels are the reference here",
            ("bitsandbytes",)),
    "2.3": ("takes the 8-bit Adam step itself: bitsandbytes and torch's Adam are the references "
            "here", ("bitsandbytes", *ADAM)),
    "2.5": ("shards the optimizer itself: ZeroRedundancyOptimizer is the reference here", ZERO),
    "2.7": ("streams Adam over the groups itself: torch's Adam is the reference here", ADAM),
    "3.1": ("keeps the scale itself: GradScaler and its scale-update kernel are the reference here",
            ("*[Gg]rad*[Ss]caler", "_amp_update_scale*")),
    "3.2": ("keeps the fp32 master and its state itself: torch's Adam optimizer is the reference "
            "here", ADAM[:2]),
    "3.4": ("splits the layers over the ranks itself: torch.distributed.tensor.parallel is the "
            "reference here", ("parallelize_module", "*wiseParallel")),
    "3.5": ("builds the pipeline schedules itself: torch.distributed.pipelining is the reference "
            "here", ("pipelining",)),
    "3.6": ("runs the pipeline stage itself: torch.distributed.pipelining is the reference here",
            ("pipelining",)),
    "3.7": ("shards the parameters itself: FSDP2's fully_shard is the reference here",
            (*ZERO[1:], *ADAM)),
    "3.8": ("builds the zero-bubble schedule itself: torch.distributed.pipelining is the "
            "reference here", ("pipelining",)),
    "4.2": ("buckets and all-reduces the gradients itself: DistributedDataParallel is the "
            "reference here", ("DistributedDataParallel", "ddp_comm_hooks")),
    "4.3": ("reduce-scatters the gradients and shards the optimizer itself: ZeRO, FSDP, DDP and "
            "torch's Adam are the references here", (*ZERO, "DistributedDataParallel", *ADAM)),
    "4.4": ("compresses the gradients itself: DDP's comm hooks are the reference here",
            ("ddp_comm_hooks",)),
    "4.5": ("runs PowerSGD itself: torch's powerSGD_hook is the reference here",
            ("ddp_comm_hooks",)),
    "5.1": ("builds the √L schedule itself: checkpoint_sequential is the reference here",
            ("checkpoint_sequential",)),
    "5.2": ("applies the schedule itself (checkpoint per segment is allowed): "
            "checkpoint_sequential is the reference here", ("checkpoint_sequential",)),
    "5.3": ("searches the schedule itself: checkpoint_sequential is the reference here",
            ("checkpoint_sequential",)),
    "5.5": ("moves the saved activations itself: save_on_cpu is the reference here",
            ("save_on_cpu",)),
    "5.6": ("computes attention itself: PyTorch's SDPA and flash kernels are the reference here",
            SDPA),
    "5.7": ("passes the key/value blocks round the ring itself: torch's context parallelism is "
            "the reference here", ("context_parallel",)),
    "5.8": ("splits the sequence over the ranks itself: SequenceParallel is the reference here",
            ("parallelize_module", "SequenceParallel")),
    "6.3": ("computes the mesh's coordinates and groups itself: DeviceMesh and unravel_index "
            "are the reference here", ("*[Dd]evice*[Mm]esh*", "*ravel*index")),
    "6.4": ("counts a layout's bytes per GPU itself: labkit.cost_model's memory model is the "
            "planner's reference here", ("cost_model",)),
    "6.5": ("fuses GELU's forward and backward itself: PyTorch's gelu kernels are the reference "
            "here", ("gelu*", "GELU")),
    "6.6": ("dispatches the tokens to the experts itself: the reference's single-device layer is "
            "what it is compared with", ("moe_reference",)),
}
"""exercise id -> (what the exercise must do itself, the patterns of what it may not use)."""


def matching(exercise: str, *names: str) -> str | None:
    """The first of ``names`` that a pattern of ``exercise`` matches, or None."""
    patterns = REBUILDS.get(exercise, ("", ()))[1]
    return next((n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)), None)


def reason(exercise: str, name: str) -> str:
    """The message of a refusal: "exercise 5.6 computes attention itself: …"."""
    return f"exercise {exercise} {REBUILDS[exercise][0]} and is refused while it is graded ({name})"

