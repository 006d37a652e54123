#!/usr/bin/env bash
# Gradescope runs this once when it builds the autograder's image. Its base images are Ubuntu
# 22.04 (Python 3.10) and 24.04 (Python 3.12, whose system pip refuses to install: PEP 668), so
# everything goes into a virtual environment, $ROOT/venv, from requirements.txt beside this
# script (pins per Python version). Then the wall around student code: util-linux's unshare and
# setpriv and the dedicated user labkit-student (ensure_isolation.sh).
#   AUTOGRADER_ROOT (default /autograder): where source/ is (a test lays it out in a temporary
#   folder); LABKIT_TORCH_INDEX (default PyTorch's CPU wheels): the extra index torch comes from.
set -euo pipefail
ROOT="${AUTOGRADER_ROOT:-/autograder}"
SOURCE="$ROOT/source"
cd "$SOURCE"
if ! python3 -c "import venv, ensurepip" 2>/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv >/dev/null
fi
bash "$SOURCE/tools/autograder/ensure_isolation.sh"
python3 -m venv "$ROOT/venv"
PIP=("$ROOT/venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
INDEX="${LABKIT_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
"${PIP[@]}" ${INDEX:+--extra-index-url "$INDEX"} -r "$SOURCE/tools/autograder/requirements.txt"
PYTHONPATH="$SOURCE/src" "$ROOT/venv/bin/python" -c "import torch, labkit.grade.cli; \
from labkit.grade import isolation; print('torch', torch.__version__, '| labkit-grade ready |', \
isolation.choose().describe())"
