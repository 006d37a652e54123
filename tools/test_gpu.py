"""`make test-gpu`: every test and every notebook on a CUDA GPU, within a few minutes.

    python tools/test_gpu.py              # with the course's .venv (make test-gpu)
    python3 tools/test_gpu.py --system    # the Python it runs on as it is (make test-gpu SYSTEM=1):
                                          # its torch (a CUDA build), no venv, no pip, no network;
                                          # labkit from this checkout's src/

The test files run ``--jobs`` at a time (one pytest process each: gloo ranks are CPU work, the
GPU is shared), then the notebooks (chapters and labs at the GPU sizes of
``labkit.models.lab_config``, two kernels at a time) through tools/execute_notebooks.py. Logs go
to ``_build/gpu/``; the summary lists each failing file, the tests that need CUDA and how they
ended (tests/conftest.py's report), and the wall time against the budget (8 minutes on one GPU).
Exit status 0 only if everything passed.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "_build" / "gpu"
BUDGET_S = 8 * 60
NEEDED = ("torch", "pytest", "nbformat", "nbclient", "jupyter_cache", "myst_nb", "yaml")


def _environment(system: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if system:  # no editable install: labkit is this checkout's src/
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _run_file(path: Path, env: dict) -> tuple[Path, int, float]:
    log = LOGS / f"{path.stem}.log"
    started = time.monotonic()
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                             str(path)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    return path, rc, time.monotonic() - started


def _cuda_report(logs: list[Path]) -> list[str]:
    """The 'tests that need CUDA' sections of the logs (tests/conftest.py writes one per run)."""
    lines = []
    for log in logs:
        on = False
        for line in log.read_text(errors="replace").splitlines():
            if "tests that need CUDA" in line:
                on = True
                continue
            if on and line.startswith("="):
                on = False
            elif on and line.strip() and not line.startswith("device:"):
                lines.append(line)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", action="store_true",
                        help="use this Python as it is (its torch, no venv, no pip); labkit from src/")
    parser.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                        help="test files run at once (default: half the cores, at most 8)")
    args = parser.parse_args(argv)
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        print(f"make test-gpu: {sys.executable} lacks {', '.join(missing)} (without a network, install "
              "them from wheels; or run make test-gpu without SYSTEM=1, which sets up .venv)", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(f"make test-gpu needs a CUDA GPU, and torch.cuda.is_available() is False here "
              f"(torch {torch.__version__})", file=sys.stderr)
        return 2
    LOGS.mkdir(parents=True, exist_ok=True)
    env, started = _environment(args.system), time.monotonic()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"{args.jobs} test files at a time; logs in {LOGS.relative_to(ROOT)}/", flush=True)
    files = sorted((ROOT / "tests").glob("test_*.py"))
    failed = []
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        for path, rc, seconds in pool.map(lambda p: _run_file(p, env), files):
            print(f"  {path.name:<40} {'ok' if rc == 0 else 'FAILED':>7} {seconds:7.1f} s", flush=True)
            if rc not in (0, 5):  # 5: no test collected
                failed.append(path.name)
    notebooks = subprocess.run([sys.executable, "tools/execute_notebooks.py", "--workers", "2",
                                "--cache", str(LOGS / ".jupyter_cache")], cwd=ROOT, env=env,
                               capture_output=True, text=True)
    (LOGS / "notebooks.log").write_text(notebooks.stdout + notebooks.stderr)
    print(notebooks.stdout)
    if notebooks.returncode:
        failed.append("notebooks (see _build/gpu/notebooks.log)")
    print("tests that need CUDA:")
    print("\n".join(_cuda_report(sorted(LOGS.glob("test_*.log")))) or "  (none reported)")
    wall = time.monotonic() - started
    print(f"make test-gpu: {'FAILED: ' + ', '.join(failed) if failed else 'all passed'}; "
          f"{wall / 60:.1f} min wall (budget {BUDGET_S // 60} min{'' if wall <= BUDGET_S else ': OVER'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
