#!/usr/bin/env bash
# The wall labkit-grade puts around student code (src/labkit/grade/isolation.py) needs, on Linux:
# util-linux's unshare and setpriv (and mount), and, when the grader runs as root, the dedicated
# unprivileged user labkit-student. This installs what is missing (apt, as root) and creates the
# user; it is idempotent, like tools/ensure_chromium.sh: run it before `make test` and in the
# autograder's setup.sh. Without it the grader still grades, and says which wall it had.
set -euo pipefail
missing=()
for tool in unshare setpriv mount; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq util-linux mount >/dev/null
  else
    echo "ensure_isolation: ${missing[*]} missing and not root: install util-linux" >&2
  fi
fi
if [ "$(id -u)" = 0 ] && ! id labkit-student >/dev/null 2>&1; then
  useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin \
    labkit-student
fi
echo "ensure_isolation: unshare $(command -v unshare || echo missing), setpriv" \
  "$(command -v setpriv || echo missing), user labkit-student" \
  "$(id -u labkit-student 2>/dev/null || echo 'absent (not root)')"
