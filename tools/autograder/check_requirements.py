"""Check that the autograder's requirements resolve, with wheels only, for each Python of
Gradescope's base images (Ubuntu 22.04: 3.10; 24.04: 3.12), without installing anything.

    python tools/autograder/check_requirements.py [3.10 3.12]

pip evaluates a requirement's environment marker (``; python_version < "3.11"``) with the Python
that runs it, not the one of ``--python-version``: this script evaluates the markers for each
target itself, then asks ``pip install --dry-run --only-binary=:all: --python-version V`` (wheel
metadata only: nothing big is downloaded). It needs the package index (PyPI); torch comes from
PyPI here, from PyPI or PyTorch's CPU index on Gradescope (the same release).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
PLATFORMS = [f"--platform=manylinux_2_{m}_x86_64" for m in range(17, 40)] + \
    ["--platform=manylinux2014_x86_64", "--platform=linux_x86_64"]


def requirements(python: str) -> list[str]:
    """The lines of requirements.txt that apply to ``python`` ("3.10"), markers removed."""
    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
           "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    out = []
    for line in (HERE / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                req.marker = None
                out.append(str(req))
    return out


def resolve(python: str) -> list[str]:
    """``name==version`` of everything pip would install for ``python``; RuntimeError if none."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                               "--ignore-installed", "--only-binary=:all:", "--python-version",
                               python, *PLATFORMS, "--target", str(Path(tmp) / "t"), "--report",
                               str(report), *requirements(python)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"Python {python}: {done.stderr.strip().splitlines()[-1]}")
        return sorted(f"{i['metadata']['name']}=={i['metadata']['version']}"
                      for i in json.loads(report.read_text())["install"])


def main(argv: list[str]) -> int:
    failed = 0
    for python in argv or ["3.10", "3.12"]:
        try:
            found = resolve(python)
            pins = [r for r in found if r.split("==")[0].lower() in
                    {Requirement(x).name.lower() for x in requirements(python)}]
            print(f"Python {python}: {len(found)} packages resolve; pinned: {', '.join(pins)}")
        except RuntimeError as exc:
            print(exc)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
