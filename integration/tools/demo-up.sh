#!/usr/bin/env bash
# `make demo`: the real path on this machine, left running. Builds the binaries and the
# images (deploy/docker/, with buildah), then starts `e2e-stack` in the background (guest
# image, libvirtd in a network namespace, sshd, and a single-node cluster into which the
# chart is installed with helm, as users install it), which applies a sample Proxy,
# waits until it is Ready, and writes what to try. `make demo-down` stops it and removes
# everything.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
state=${EGRESSPROXY_DEMO_DIR:-/tmp/egressproxy-demo}

if [ -f "$state/pid" ] && kill -0 "$(cat "$state/pid")" 2>/dev/null; then
  echo "demo: already running (pid $(cat "$state/pid"))"
  cat "$state/README" 2>/dev/null || echo "demo: still starting; see $state.log"
  exit 0
fi
[ "$(id -u)" -eq 0 ] || { echo "demo: needs root (network namespace, libvirtd, a system user)" >&2; exit 1; }

cargo build --quiet --locked --workspace --bins
integration/tools/build-images.sh product target/debug >/dev/null
rm -rf "$state"
mkdir -p "$state"
# Made here, not by the background job's redirection, which may come after the first read.
: >"$state.log"
EGRESSPROXY_BIN_DIR=$PWD/target/debug setsid nohup target/debug/e2e-stack --state-dir "$state" \
  >"$state.log" 2>&1 </dev/null &
stack=$!
echo "demo: starting (pid $stack; progress in $state.log)"
shown=0
until [ -f "$state/README" ]; do
  if ! kill -0 "$stack" 2>/dev/null; then
    echo "demo: the stack did not come up:" >&2
    cat "$state.log" >&2
    exit 1
  fi
  lines=$(wc -l <"$state.log")
  if [ "$lines" -gt "$shown" ]; then
    sed -n "$((shown + 1)),${lines}p" "$state.log" | grep -E '^(e2e-stack|guest-image):' || true
    shown=$lines
  fi
  sleep 1
done
echo
cat "$state/README"
