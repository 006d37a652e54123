#!/usr/bin/env bash
# Screenshot a page of the built book with headless Chromium, served from 127.0.0.1; every
# other host is made unresolvable, so the picture shows what an offline reader sees.
#
#   tools/screenshot.sh PAGE OUT.png [WIDTHxHEIGHT]
#
# PAGE is a path inside _build/html (e.g. book/01_where_the_memory_goes.html). Build first
# (`make book`). Serves _build/html on a free local port, takes the screenshot after 10 s of
# virtual time (enough for MathJax and the widgets to draw), and stops the server. The server's
# request log is kept in OUT.png.log: every file the page asked for, with its status, so a
# missing vendored file (404) shows up. Needs Debian's `chromium` (apt-get install chromium).
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 PAGE OUT.png [WIDTHxHEIGHT]" >&2
    exit 2
fi
page=${1#/}
out=$2
size=${3:-1200x2000}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
site="$root/_build/html"
python=${PYTHON:-python3}

[[ -f "$site/$page" ]] || { echo "no $site/$page: build the book first" >&2; exit 1; }
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[[ -n "$browser" ]] || { echo "no chromium: apt-get install chromium" >&2; exit 1; }

port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$python" -m http.server "$port" --bind 127.0.0.1 --directory "$site" >"$out.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT

for _ in $(seq 50); do  # wait until the server answers (at most 5 s)
    "$python" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" \
        2>/dev/null && break
    sleep 0.1
done

profile=$(mktemp -d)
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -rf "$profile"' EXIT
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --user-data-dir="$profile" --no-first-run --no-default-browser-check \
    --host-resolver-rules="MAP * ~NOTFOUND, EXCLUDE 127.0.0.1" \
    --window-size="${size/x/,}" --virtual-time-budget=10000 \
    --screenshot="$(realpath -m "$out")" "http://127.0.0.1:$port/$page" 2>/dev/null
missing=$(grep '" 404 ' "$out.log" | grep -vc 'GET /favicon.ico' || true)
echo "$out ($missing files missing; the requests are in $out.log)"
