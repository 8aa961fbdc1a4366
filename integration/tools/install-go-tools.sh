#!/usr/bin/env bash
# Builds the pinned Go test tooling (grpcurl, buf, helm) from the Go module proxy into
# one cache directory. A warm run finds every binary at its pinned version and builds
# nothing. Test tooling only: the product is Rust.
#
# Usage: integration/tools/install-go-tools.sh        # prints the bin directory
# Env:   EGRESSPROXY_TOOLS_DIR  cache directory (default: $XDG_CACHE_HOME/egressproxy/tools)
set -euo pipefail

GRPCURL_VERSION=v1.9.4
BUF_VERSION=v1.75.0
HELM_VERSION=v3.22.0

cache="${EGRESSPROXY_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/egressproxy/tools}"
bin="$cache/bin"
mkdir -p "$bin"

if ! command -v go >/dev/null 2>&1; then
  for candidate in /usr/local/go/bin /usr/lib/go/bin; do
    [ -x "$candidate/go" ] && PATH="$candidate:$PATH"
  done
fi
if ! command -v go >/dev/null 2>&1; then
  echo "install-go-tools: no Go toolchain on PATH. Install Go 1.24 or newer (e.g. 'apt-get install golang-go' or /usr/local/go) and rerun." >&2
  exit 1
fi

# install NAME MODULE_PATH VERSION: go install unless $bin/NAME.version already says VERSION.
install() {
  local name=$1 pkg=$2 version=$3
  if [ -x "$bin/$name" ] && [ "$(cat "$bin/$name.version" 2>/dev/null)" = "$version" ]; then
    return 0
  fi
  echo "install-go-tools: building $name $version (first run on this machine; later runs reuse it)" >&2
  if ! GOBIN="$bin" GOFLAGS=-mod=mod CGO_ENABLED=0 go install "$pkg@$version" >&2; then
    echo "install-go-tools: 'go install $pkg@$version' failed. Check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY)) and rerun." >&2
    exit 1
  fi
  echo "$version" >"$bin/$name.version"
}

install grpcurl github.com/fullstorydev/grpcurl/cmd/grpcurl "$GRPCURL_VERSION"
install buf github.com/bufbuild/buf/cmd/buf "$BUF_VERSION"
install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION"

echo "$bin"
