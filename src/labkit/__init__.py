"""labkit: the package of the course *Where the Memory Goes*.

Two rooms:

* ``labkit/lab1/`` … ``labkit/lab7/``: **the student's room**. Each holds exactly one lab's
  exercise modules (one technique per module, named after it: ``labkit.lab2.zero1``,
  ``labkit.lab5.flash_attention``); the lab package's docstring is the lab's map.
* everything at the top of ``labkit``: **the course's toolkit**, complete and tested: ``models``
  (the course's GPT and its synthetic data), ``measure`` (bytes by consumer with PyTorch's
  MemTracker, FLOPs), ``ranks`` (launch N real ranks), ``plot`` (one figure style), ``widgets``,
  ``grade`` (the grader, and the pytest plugin behind ``check``), the references the graders compare with.
  Use it; don't edit it.

Setting ``LABKIT_SOLUTIONS=<path to solutions/>`` before the first ``import labkit`` makes
``import labkit.labN.<module>`` load the reference solution instead of the student stub: each lab
package puts ``solutions/labkit/labN`` in front of its own search path (``solutions_overlay``).
The toolkit is never overlaid: there is one copy of it.
"""
from __future__ import annotations

import os as _os

MIN_TORCH = (2, 7)
"""The oldest torch labkit runs on: the newest of the APIs the course uses (``TORCH_APIS``)."""

TORCH_APIS = {
    "torch.distributed._tools.mem_tracker.MemTracker (labkit.measure)": (2, 5),
    "torch.optim.Adafactor (lab 2)": (2, 5),
    "torch.distributed.tensor: DTensor, parallelize_module (tensor parallelism)": (2, 5),
    "torch.distributed.fsdp.fully_shard, FSDP2's public import path (ZeRO-3)": (2, 6),
    "torch.utils.checkpoint.create_selective_checkpoint_contexts (lab 5)": (2, 4),
    "torch.distributed.pipelining (pipeline parallelism)": (2, 4),
    "Tensor.register_post_accumulate_grad_hook (LOMO)": (2, 1),
    "torch._scaled_mm on CPU (FP8, mixed precision)": (2, 7),
}
"""Each API the course relies on and the torch release that first has it. Two newer names are
shimmed on older releases by ``labkit.torch_compat`` rather than raising the minimum:
``SelectiveCheckpointContext.op_output`` (lab 5; torch 2.13) and ``dist.all_gather_single``
(lab 4; torch 2.13). Known gap: torch 2.9's own ``torch.distributed.pipelining`` aborts a gloo
rank ("Received data size doesn't match expected size"), so lab 3's comparison with it needs a
newer torch."""


def _release(version: str) -> tuple[int, ...]:
    """(2, 7, 1) from "2.7.1+cu126"; (2, 8, 0) from "2.8.0a0+git1234" or "2.8.0.dev20250101"."""
    import re

    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    return tuple(int(g) for g in match.groups() if g is not None) if match else ()


def check_torch_version(version: str) -> None:
    """Raise ImportError, naming what is missing, if ``version`` is older than ``MIN_TORCH``."""
    have = _release(version)
    if have and have < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        missing = "; ".join(api for api, since in TORCH_APIS.items() if have < since)
        raise ImportError(
            f"labkit needs torch >= {need}, and this Python has torch {version}, which lacks: "
            f"{missing}. Upgrade with:  pip install -U 'torch>={need}'  (on Colab: restart the "
            "runtime afterwards)"
        )


def _installed_torch() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


_torch_version = _installed_torch()
if _torch_version is not None:
    check_torch_version(_torch_version)



def _solutions_root() -> str | None:
    """``$LABKIT_SOLUTIONS/labkit``, checked, or None when the variable is unset or empty."""
    solutions = _os.environ.get("LABKIT_SOLUTIONS")
    if not solutions:
        return None
    root = _os.path.join(_os.path.abspath(solutions), "labkit")
    if not _os.path.isdir(root):
        raise ImportError(
            f"LABKIT_SOLUTIONS={solutions!r} has no labkit/ folder; "
            "point it at the repository's solutions/ directory or unset it"
        )
    return root


_SOLUTIONS_ROOT = _solutions_root()


def solutions_overlay(package_path: list[str], lab: str) -> None:
    """Put ``$LABKIT_SOLUTIONS/labkit/<lab>`` first on a lab package's ``__path__``.

    Called by each ``labkit/labN/__init__.py``: with the variable set, ``import
    labkit.labN.zero1`` finds the solution's module before the stub beside it.
    """
    if _SOLUTIONS_ROOT is None:
        return
    overlay = _os.path.join(_SOLUTIONS_ROOT, lab)
    if _os.path.isdir(overlay) and overlay not in package_path:
        package_path.insert(0, overlay)

__version__ = "0.1.0"


def check(exercise: str, *, verbose: bool = False) -> bool:
    """Run the graded tests of one exercise (e.g. ``check("1.2")``) and print a short report.

    The tests run in a fresh Python process, so the code you just edited is what gets graded.
    A failed test prints its own message (what was expected, what came back, the likely cause);
    ``verbose=True`` adds the traceback and details. Returns True when every test that could run
    here passed (a test that needs CUDA on a CPU machine, or one whose optional reference
    library is missing, is reported but does not count).

    If the lab's code cannot even be imported (a syntax error, a misspelt import), no test can
    run: the report names the file, the line and the error instead, and returns False.
    """
    from labkit.grade.plugin import check as _check

    import subprocess

    exercise = _exercise_id(exercise)
    try:
        return _check(exercise, verbose=verbose)
    except subprocess.TimeoutExpired as exc:
        print(f"exercise {exercise}: not graded: its tests had not finished after {exc.timeout:g} s "
              "and were stopped. Look for a loop that never ends in your code (or a rank waiting for "
              "a peer that never sends); run the lab's cell for it to see where it stays.")
        return False
    except (ValueError, RuntimeError):
        broken = _modules_that_fail_to_import(exercise.split(".")[0])
        if not broken:
            raise
        print(f"exercise {exercise}: not graded: the lab's code does not import, so no test could run.")
        for module, error in broken.items():
            print(f"  {module}:\n        " + error.replace("\n", "\n        "))
        print(f"  Fix the line shown, save the file, and run labkit.check({exercise!r}) again "
              "(in a notebook with %autoreload, re-run the cell that imports it too).")
        return False


def _exercise_id(exercise) -> str:
    """``exercise`` as an id "N.E" of a lab that exists; else a ValueError saying what to pass
    (a float such as 1.2 is refused: 1.10 and 1.1 would be the same number)."""
    if not isinstance(exercise, str):  # a ValueError, as for any other malformed id
        raise ValueError(f"exercise must be an exercise id such as '1.2', a str (with quotes: "
                         f"labkit.check('1.2')), got {exercise!r} ({type(exercise).__name__})")
    lab, _, number = exercise.strip().partition(".")
    if not (lab.isdigit() and number.isdigit()):
        raise ValueError(f"exercise must be an exercise id such as '1.2' (lab 1, exercise 2), "
                         f"got {exercise!r}")
    labs = sorted(int(p.name[3:]) for p in _labs_dir().glob("lab[0-9]*") if p.name[3:].isdigit())
    if int(lab) not in labs:
        raise ValueError(f"exercise={exercise!r}: there is no lab {int(lab)}; the known exercises are "
                         f"those of labs {', '.join(map(str, labs))} (an id is 'lab.exercise', e.g. "
                         f"'{labs[0]}.1')")
    return f"{int(lab)}.{int(number)}"


def _labs_dir():
    from pathlib import Path

    return Path(__file__).resolve().parent


def _modules_that_fail_to_import(lab: str) -> dict[str, str]:
    """{module: the last lines of its import error} for each module of ``labkit.lab<lab>`` that
    does not import, tried in a fresh process (as the grader imports them)."""
    import subprocess
    import sys

    names = sorted(p.stem for p in (_labs_dir() / f"lab{lab}").glob("*.py") if p.stem != "__init__")
    probe = (
        "import importlib, json, sys, traceback\n"
        "out = {}\n"
        f"for name in {names!r}:\n"
        f"    module = 'labkit.lab{lab}.' + name\n"
        "    try:\n"
        "        importlib.import_module(module)\n"
        "    except BaseException as exc:\n"
        "        lines = traceback.format_exception_only(type(exc), exc)\n"
        "        tb = traceback.extract_tb(exc.__traceback__)\n"
        "        where = [f'{f.filename}, line {f.lineno}' for f in tb if '/labkit/lab' in f.filename]\n"
        "        out[module] = ''.join((where[-1:] and [where[-1] + '\\n']) + lines).strip()\n"
        "print(json.dumps(out))\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
        import json

        return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    except Exception:  # noqa: BLE001 - a diagnosis that fails leaves the grader's own error
        return {}
