#!/usr/bin/env bash
# Install Debian's headless Chromium for tools/site_check.py, only when no Chromium is on PATH.
# Needs root (or passwordless sudo), as on CI and in the course's container:
#   apt-get update && apt-get install -y chromium
# fonts-noto-cjk is NOT installed on purpose: the site ships its own CJK subset
# (book/_static/fonts/), and the check must see what a reader without CJK fonts sees.
set -euo pipefail
for b in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$b" >/dev/null; then exit 0; fi
done
sudo=""
if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "ensure_chromium: not root and no sudo: apt-get install -y chromium" >&2; exit 1; }
    sudo="sudo"
fi
echo "ensure_chromium: installing chromium (apt-get) ..."
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null
command -v chromium >/dev/null
