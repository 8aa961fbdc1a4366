#!/usr/bin/env bash
# Builds the pinned Go test tooling (grpcurl, buf, helm, kube-harness, kube-node, coredns, the
# protoc-gen-go and protoc-gen-go-grpc plugins, and the Go client's dependencies) from the
# Go module proxy into one cache directory. A warm run finds every binary at its pinned version and
# builds nothing. Test tooling only: the product is Rust.
#
# Usage: integration/tools/install-go-tools.sh [TOOL...]   # prints the bin directory
#        With TOOL names (grpcurl, buf, helm, kube-harness, kube-node, coredns,
#        protoc-gen-go, protoc-gen-go-grpc, go-client), builds only those.
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
    grpcurl | buf | helm | kube-harness | kube-node | coredns | protoc-gen-go | protoc-gen-go-grpc | go-client) ;;
    *) echo "install-go-tools: unknown tool '$name': choose from grpcurl, buf, helm, kube-harness, kube-node, coredns, protoc-gen-go, protoc-gen-go-grpc, go-client" >&2; exit 2 ;;
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

# build_module NAME DIR PACKAGE KEY LDFLAGS: go build PACKAGE of the module in DIR into
# $bin/NAME, unless $bin/NAME.version already says KEY (a hash of the module's sources).
build_module() {
  local name=$1 dir=$2 pkg=$3 key=$4 ldflags=$5
  wanted "$name" || return 0
  if [ -x "$bin/$name" ] && [ "$(cat "$bin/$name.version" 2>/dev/null)" = "$key" ]; then
    return 0
  fi
  echo "install-go-tools: building $name (a cold build takes several minutes, later runs reuse it)" >&2
  if ! (cd "$dir" && GOFLAGS=-mod=readonly go mod download >&2); then
    echo "install-go-tools: downloading the modules of $dir failed. Check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY)) and rerun." >&2
    exit 1
  fi
  if ! (cd "$dir" && GOFLAGS=-mod=readonly CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$bin/$name.tmp" "$pkg" >&2); then
    echo "install-go-tools: building $name failed (see the compiler output above). It needs Go 1.26 or newer; 'go version' says: $(go version)" >&2
    exit 1
  fi
  mv "$bin/$name.tmp" "$bin/$name"
  echo "$key" >"$bin/$name.version"
}

tools_src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# kube-harness: a real kube-apiserver with an embedded etcd, and kube-node: the kubelet,
# kube-proxy, kube-scheduler and kube-controller-manager, both built from the one Go module
# in integration/kube-harness (see docs/testing/kube-apiserver.md and
# docs/testing/kube-cluster.md), so they share one download and one build cache. Each is
# keyed on a hash of that module's go.mod and go.sum and its own sources: a warm run
# builds nothing, any change rebuilds.
harness_src="$tools_src/kube-harness"
k8s_version="$(awk '$1 == "k8s.io/kubernetes" { print $2; exit }' "$harness_src/go.mod")"
k8s_minor="$(echo "$k8s_version" | cut -d. -f2)"
# The components report the version they were built as; without these they say
# v0.0.0-master, which clients and charts with a kubeVersion constraint reject.
k8s_ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags="$k8s_ldflags -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor -X $pkg.gitTreeState=clean"
done
harness_key="$(cd "$harness_src" && cat go.mod go.sum ./*.go | sha256sum | cut -c1-16)"
build_module kube-harness "$harness_src" . "$harness_key" "$k8s_ldflags"
node_key="$(cd "$harness_src" && cat go.mod go.sum cmd/kube-node/*.go | sha256sum | cut -c1-16)"
build_module kube-node "$harness_src" ./cmd/kube-node "$node_key" "-s -w $k8s_ldflags"

# coredns: CoreDNS with the plugins a test cluster needs, from its own module in
# integration/coredns (its Kubernetes client libraries are not the harness's).
coredns_src="$tools_src/coredns"
coredns_key="$(cd "$coredns_src" && cat go.mod go.sum ./*.go | sha256sum | cut -c1-16)"
build_module coredns "$coredns_src" . "$coredns_key" "-s -w"

echo "$bin"
