#!/usr/bin/env bash
# Gradescope runs this once when the autograder is built: install the course's environment
# (the pinned requirements, torch on the CPU) and the course itself from /autograder/source.
set -euo pipefail
cd /autograder/source
apt-get update -qq && apt-get install -y -qq python3 python3-pip python3-venv git >/dev/null || true
python3 -m pip install --quiet --upgrade pip
python3 -m pip install --quiet --extra-index-url https://download.pytorch.org/whl/cpu -r requirements.txt
python3 -m pip install --quiet --no-deps -e .
python3 -c "import torch, labkit.grade; print('torch', torch.__version__, '| labkit-grade ready')"
