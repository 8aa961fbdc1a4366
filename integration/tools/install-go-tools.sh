#!/usr/bin/env bash
# Builds the pinned Go test tooling (grpcurl, buf, helm, kube-harness, the protoc-gen-go and
# protoc-gen-go-grpc plugins, and the Go client's dependencies) from the Go module proxy
# into one cache directory. A warm run finds every binary at its pinned version and
# builds nothing. Test tooling only: the product is Rust.
#
# Usage: integration/tools/install-go-tools.sh [TOOL...]   # prints the bin directory
#        With TOOL names (grpcurl, buf, helm, kube-harness, protoc-gen-go,
#        protoc-gen-go-grpc, go-client), builds only those.
# Env:   EGRESSPROXY_TOOLS_DIR  cache directory (default: $XDG_CACHE_HOME/egressproxy/tools)
set -euo pipefail

GRPCURL_VERSION=v1.9.4
BUF_VERSION=v1.75.0
HELM_VERSION=v3.22.0
# The plugins docs/contract.md's Go code generation names (buf.gen.go.yaml runs them).
PROTOC_GEN_GO_VERSION=v1.36.12
PROTOC_GEN_GO_GRPC_VERSION=v1.6.2

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

# wanted NAME: true when NAME was asked for on the command line, or none were.
requested=("$@")
for name in "${requested[@]}"; do
  case "$name" in
    grpcurl | buf | helm | kube-harness | protoc-gen-go | protoc-gen-go-grpc | go-client) ;;
    *) echo "install-go-tools: unknown tool '$name': choose from grpcurl, buf, helm, kube-harness, protoc-gen-go, protoc-gen-go-grpc, go-client" >&2; exit 2 ;;
  esac
done
wanted() {
  [ ${#requested[@]} -eq 0 ] && return 0
  local name
  for name in "${requested[@]}"; do [ "$name" = "$1" ] && return 0; done
  return 1
}

# ensure NAME MODULE_PATH VERSION: go install unless $bin/NAME.version already says VERSION.
ensure() {
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

# install NAME MODULE_PATH VERSION: ensure NAME when it was asked for (or nothing was).
install() {
  wanted "$1" || return 0
  ensure "$@"
}

install grpcurl github.com/fullstorydev/grpcurl/cmd/grpcurl "$GRPCURL_VERSION"
install buf github.com/bufbuild/buf/cmd/buf "$BUF_VERSION"
install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION"
install protoc-gen-go google.golang.org/protobuf/cmd/protoc-gen-go "$PROTOC_GEN_GO_VERSION"
install protoc-gen-go-grpc google.golang.org/grpc/cmd/protoc-gen-go-grpc "$PROTOC_GEN_GO_GRPC_VERSION"

# go-client: the Go client of integration/go-client is generated and built by its test
# (integration/tests/go_client.rs), from the proto of the checkout. Here it is generated
# and built once the same way, so its modules are downloaded and compiled into Go's
# caches and the test's build is a warm one. Keyed on a hash of its go.mod, go.sum and
# sources.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
client_src="$repo/integration/go-client"
client_key="$(cd "$client_src" && cat go.mod go.sum ./*.go | sha256sum | cut -c1-16)"
if wanted go-client && [ "$(cat "$bin/go-client.version" 2>/dev/null)" != "$client_key" ]; then
  ensure buf github.com/bufbuild/buf/cmd/buf "$BUF_VERSION"
  ensure protoc-gen-go google.golang.org/protobuf/cmd/protoc-gen-go "$PROTOC_GEN_GO_VERSION"
  ensure protoc-gen-go-grpc google.golang.org/grpc/cmd/protoc-gen-go-grpc "$PROTOC_GEN_GO_GRPC_VERSION"
  echo "install-go-tools: building the Go client once (downloads and compiles grpc-go and protobuf)" >&2
  work="$(mktemp -d)"
  cp "$client_src"/main.go "$client_src"/go.mod "$client_src"/go.sum "$work"/
  if ! (cd "$repo" && PATH="$bin:$PATH" "$bin/buf" generate --template buf.gen.go.yaml -o "$work" >&2) \
     || ! (cd "$work" && GOFLAGS=-mod=readonly go build -o /dev/null . >&2); then
    rm -rf "$work"
    echo "install-go-tools: building the Go client failed (see above). Check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY)) and rerun." >&2
    exit 1
  fi
  rm -rf "$work"
  echo "$client_key" >"$bin/go-client.version"
fi

# kube-harness: a real kube-apiserver with an embedded etcd, built from the Go module in
# integration/kube-harness (see docs/testing/kube-apiserver.md). Keyed on a hash of that
# module's go.mod, go.sum and sources: a warm run builds nothing, any change rebuilds.
harness_src="$(cd "$(dirname "${BASH_SOURCE[0]}")/../kube-harness" && pwd)"
harness_key="$(cd "$harness_src" && cat go.mod go.sum ./*.go | sha256sum | cut -c1-16)"
if wanted kube-harness && { ! [ -x "$bin/kube-harness" ] || [ "$(cat "$bin/kube-harness.version" 2>/dev/null)" != "$harness_key" ]; }; then
  k8s_version="$(awk '$1 == "k8s.io/kubernetes" { print $2; exit }' "$harness_src/go.mod")"
  k8s_minor="$(echo "$k8s_version" | cut -d. -f2)"
  echo "install-go-tools: building kube-harness (kube-apiserver $k8s_version + etcd; a cold build takes several minutes, later runs reuse it)" >&2
  if ! (cd "$harness_src" && GOFLAGS=-mod=readonly go mod download >&2); then
    echo "install-go-tools: downloading the kube-harness modules failed. Check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY)) and rerun." >&2
    exit 1
  fi
  # The apiserver reports the version it was built as; without these it says v0.0.0-master,
  # which clients and charts with a kubeVersion constraint reject.
  ldflags=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags="$ldflags -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor -X $pkg.gitTreeState=clean"
  done
  if ! (cd "$harness_src" && GOFLAGS=-mod=readonly CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$bin/kube-harness.tmp" . >&2); then
    echo "install-go-tools: building kube-harness failed (see the compiler output above). It needs Go 1.26 or newer; 'go version' says: $(go version)" >&2
    exit 1
  fi
  mv "$bin/kube-harness.tmp" "$bin/kube-harness"
  echo "$harness_key" >"$bin/kube-harness.version"
fi

echo "$bin"
