#!/usr/bin/env bash
# Creates the Python virtualenv the contract's non-Rust tests use: grpcio and its
# reflection, health and status packages (an independent gRPC client and the example
# provider under integration/example-providers/python/), and grpcio-tools, which
# generates Python code from proto/ with its bundled protoc (no system protoc needed).
# A warm run finds the venv at its pinned versions and installs nothing.
#
# Usage: integration/tools/install-python-tools.sh   # prints the venv's python
# Env:   EGRESSPROXY_TOOLS_DIR  cache directory (default: $XDG_CACHE_HOME/egressproxy/tools)
set -euo pipefail

GRPCIO_VERSION=1.85.1

cache="${EGRESSPROXY_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/egressproxy/tools}"
venv="$cache/python"
stamp="$venv/.egressproxy-version"

if [ "$(cat "$stamp" 2>/dev/null)" != "$GRPCIO_VERSION" ]; then
  if ! python3 -m venv --help >/dev/null 2>&1; then
    echo "install-python-tools: python3 with the venv module is needed (Debian: apt-get install python3-venv)." >&2
    exit 1
  fi
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check \
    "grpcio==$GRPCIO_VERSION" "grpcio-tools==$GRPCIO_VERSION" \
    "grpcio-reflection==$GRPCIO_VERSION" "grpcio-health-checking==$GRPCIO_VERSION" \
    "grpcio-status==$GRPCIO_VERSION"
  echo "$GRPCIO_VERSION" >"$stamp"
fi
echo "$venv/bin/python"
