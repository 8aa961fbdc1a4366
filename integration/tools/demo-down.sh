#!/usr/bin/env bash
# `make demo-down`: stops what `make demo` started; the stack removes its VM, libvirtd,
# network namespace, user and directories on the way out.
set -euo pipefail
state=${EGRESSPROXY_DEMO_DIR:-/tmp/egressproxy-demo}
if ! [ -f "$state/pid" ]; then
  echo "demo-down: no demo is running (no $state/pid)"
  exit 0
fi
pid=$(cat "$state/pid")
if kill -TERM "$pid" 2>/dev/null; then
  echo "demo-down: stopping pid $pid"
  while kill -0 "$pid" 2>/dev/null; do sleep 0.5; done
fi
rm -rf "$state" "$state.log"
echo "demo-down: stopped"
