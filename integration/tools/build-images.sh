#!/usr/bin/env bash
# Builds the container images the in-cluster tests run, with buildah (daemonless, from
# Debian's packages), and writes each as a docker-archive that the test cluster's
# containerd imports (`ctr images import`). Nothing can be pulled from a registry here,
# so every image starts from `scratch` or from a base made here from Debian's packages
# (docs/adr/0017-images-built-with-buildah-from-local-bases.md).
#
# Usage: integration/tools/build-images.sh cluster          # make setup
#        integration/tools/build-images.sh bases            # make setup
#        integration/tools/build-images.sh product BINDIR   # make images
#        integration/tools/build-images.sh product BINDIR SHORT...   # only these
#
#   cluster: pause (the pod sandbox, Kubernetes' pause.c compiled statically), coredns
#            (the binary integration/tools/install-go-tools.sh builds) and toolbox
#            (Debian's busybox-static, for test pods). Needs kube-node and coredns built.
#   bases:   the base images the Dockerfiles name, made from bookworm's packages under
#            local names (integration/images/bases/): debian-slim (debootstrap minbase)
#            and distroless-cc (glibc, libgcc, OpenSSL, CA certificates; no shell).
#   product: deploy/docker/operator.Dockerfile, kvm-agent.Dockerfile and
#            kube-provider.Dockerfile, the files users build, given the local bases
#            through their build arguments and the binaries in BINDIR
#            (egressproxy-operator, kvm-agent, kube-provider: what cargo built) through
#            the `binaries` build context, tagged with the chart's default image names;
#            and squid-proxy.Dockerfile, the proxy image kube-provider runs by default
#            (Debian's squid, no binary of ours). SHORT names limit the set (operator,
#            kvm-agent, kube-provider, squid-proxy), e.g. to skip a binary not built.
#
# Each image is keyed on a hash of its inputs (Containerfile or Dockerfile, files,
# binaries, base): a warm run finds every archive at its key and builds nothing.
# Prints the images directory.
# Env:   EGRESSPROXY_TOOLS_DIR  cache directory (default: $XDG_CACHE_HOME/egressproxy/tools)
#        EGRESSPROXY_DEBIAN_MIRROR  Debian mirror for the bases (default: the system's)
set -euo pipefail

cache="${EGRESSPROXY_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/egressproxy/tools}"
bin="$cache/bin"
images="$cache/images"
storage="$cache/containers"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$images" "$storage"

set_name=${1:-}
case "$set_name" in
  cluster | bases) [ $# -eq 1 ] || set_name="" ;;
  product) [ $# -ge 2 ] || set_name="" ;;
  *) set_name="" ;;
esac
if [ -z "$set_name" ]; then
  echo "usage: $0 cluster | bases | product BINDIR [SHORT...]" >&2
  exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "build-images: must run as root (buildah's overlay storage and RUN steps need it)" >&2
  exit 1
fi
if ! command -v buildah >/dev/null 2>&1; then
  echo "build-images: buildah not found: run integration/tools/install-system-packages.sh" >&2
  exit 1
fi
# One build at a time per cache: buildah's storage and the archives are shared.
exec 9>"$images/.lock"
flock 9

# A private image store in the cache, so nothing touches /var/lib/containers.
buildah_() {
  buildah --root "$storage/root" --runroot "$storage/runroot" --storage-driver overlay "$@"
}

# hash_dir DIR: a short hash of every file under DIR, names and contents.
hash_dir() {
  (cd "$1" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
}

# build_image SHORT NAME CONTEXT [EXTRA_KEY [BUILDAH_BUD_ARGS...]]: builds
# CONTEXT/Containerfile (or the -f file among the arguments) as NAME and writes
# $images/SHORT.tar, unless $images/SHORT.key already holds the hash of the context and
# EXTRA_KEY.
build_image() {
  local short=$1 name=$2 context=$3 extra=${4:-}
  shift 3
  [ $# -gt 0 ] && shift
  local key
  key="$(echo "$(hash_dir "$context") $extra" | sha256sum | cut -c1-16)"
  if [ -f "$images/$short.tar" ] && [ "$(cat "$images/$short.key" 2>/dev/null)" = "$key" ]; then
    return 0
  fi
  echo "build-images: building $name" >&2
  local file=()
  [ $# -eq 0 ] && file=(-f "$context/Containerfile")
  if ! buildah_ bud --quiet --isolation chroot --pull-never --layers -t "$name" "${file[@]}" "$@" "$context" >&2; then
    echo "build-images: building $name failed (buildah's output above)" >&2
    exit 1
  fi
  rm -f "$images/$short.tar.tmp"
  buildah_ push --quiet "$name" "docker-archive:$images/$short.tar.tmp:$name" >&2
  mv "$images/$short.tar.tmp" "$images/$short.tar"
  echo "$name" >"$images/$short.name"
  echo "$key" >"$images/$short.key"
}

# context SHORT: a fresh build context holding integration/images/SHORT.Containerfile.
context() {
  local dir="$work/$1"
  mkdir -p "$dir"
  cp "$here/images/$1.Containerfile" "$dir/Containerfile"
  echo "$dir"
}

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cluster_images() {
  # pause: Kubernetes' own pause.c from the k8s.io/kubernetes module the harness pins.
  k8s_version="$(awk '$1 == "k8s.io/kubernetes" { print $2; exit }' "$here/kube-harness/go.mod")"
  pause_c="$(cd "$here/kube-harness" && go mod download -json "k8s.io/kubernetes@$k8s_version" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')/build/pause/linux/pause.c"
  if [ ! -f "$pause_c" ]; then
    echo "build-images: $pause_c not found: check that the Go module proxy is reachable" >&2
    exit 1
  fi
  dir="$(context pause)"
  gcc -Os -static -Wall -Werror -DVERSION="$k8s_version" -o "$dir/pause" "$pause_c"
  build_image pause localhost/egressproxy-test/pause:3.10 "$dir"

  for tool in coredns; do
    if [ ! -x "$bin/$tool" ]; then
      echo "build-images: $bin/$tool not found: run integration/tools/install-go-tools.sh first" >&2
      exit 1
    fi
  done
  dir="$(context coredns)"
  cp "$bin/coredns" "$dir/coredns"
  build_image coredns localhost/egressproxy-test/coredns:1.15.0 "$dir"

  if ! dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'install ok installed'; then
    echo "build-images: Debian's busybox-static is needed: run integration/tools/install-system-packages.sh" >&2
    exit 1
  fi
  dir="$(context toolbox)"
  cp /bin/busybox "$dir/busybox"
  build_image toolbox localhost/egressproxy-test/toolbox:1 "$dir"

}

mirror=${EGRESSPROXY_DEBIAN_MIRROR:-}
if [ -z "$mirror" ] && [ -f /etc/apt/sources.list.d/debian.sources ]; then
  mirror=$(awk '/^URIs:/ && !/security/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
fi
mirror=${mirror:-http://deb.debian.org/debian}

# The local names of the bases, which the product images get through build arguments.
DEBIAN_BASE=localhost/egressproxy-base/debian:bookworm-slim
DISTROLESS_BASE=localhost/egressproxy-base/distroless-cc-debian12:nonroot

# base_image SHORT NAME RECIPE CONFIG...: runs integration/images/bases/RECIPE into a
# fresh root filesystem and commits it as NAME with buildah's CONFIG options, unless
# $images/SHORT.key holds the recipe's hash and NAME is in the store.
base_image() {
  local short=$1 name=$2 recipe="$here/images/bases/$3"
  shift 3
  local key
  key="$(sha256sum "$recipe" | cut -c1-16)"
  if [ "$(cat "$images/$short.key" 2>/dev/null)" = "$key" ] && buildah_ inspect --type image "$name" >/dev/null 2>&1; then
    return 0
  fi
  echo "build-images: making the base $name from bookworm's packages ($mirror)" >&2
  local root="$work/$short-root"
  "$recipe" "$root" "$mirror" "$images/debs-$short"
  tar -C "$root" -cf "$work/$short.tar" .
  local container
  container="$(buildah_ from scratch)"
  buildah_ add --quiet "$container" "$work/$short.tar" / >&2
  buildah_ config "$@" "$container" >&2
  buildah_ commit --quiet --rm "$container" "$name" >&2
  rm -rf "$root" "$work/$short.tar"
  echo "$key" >"$images/$short.key"
}

base_images() {
  command -v debootstrap >/dev/null || {
    echo "build-images: debootstrap is missing: run integration/tools/install-system-packages.sh" >&2
    exit 1
  }
  base_image base-debian-slim "$DEBIAN_BASE" debian-slim.sh \
    --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  base_image base-distroless-cc "$DISTROLESS_BASE" distroless-cc.sh \
    --user 65532 --workingdir /home/nonroot \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
}

# product_image SHORT DOCKERFILE BINARY NAME BASE_ARG BASE: the runtime stage of
# deploy/docker/DOCKERFILE with BINDIR/BINARY as the `binaries` build context's
# out/BINARY and BASE as the build argument BASE_ARG.
product_image() {
  local short=$1 dockerfile="$here/../deploy/docker/$2" binary=$3 name=$4 base_arg=$5 base=$6
  if [ ! -x "$bindir/$binary" ]; then
    echo "build-images: $bindir/$binary not found: build it first (cargo build -p ... --bins)" >&2
    exit 1
  fi
  if ! buildah_ inspect --type image "$base" >/dev/null 2>&1; then
    echo "build-images: the base $base is missing: run '$0 bases' (make setup does)" >&2
    exit 1
  fi
  local binaries="$work/$short-binaries" context="$work/$short-context"
  mkdir -p "$binaries/out" "$context"
  cp "$dockerfile" "$context/Dockerfile"
  ln "$bindir/$binary" "$binaries/out/$binary" 2>/dev/null || cp "$bindir/$binary" "$binaries/out/$binary"
  local extra
  extra="$(sha256sum "$bindir/$binary" | cut -c1-16) $(buildah_ inspect --type image --format '{{.FromImageID}}' "$base")"
  build_image "$short" "$name" "$context" "$extra" \
    -f "$context/Dockerfile" --build-arg "$base_arg=$base" --build-context "binaries=$binaries"
}

# wanted SHORT: whether the product set includes SHORT (all without SHORT arguments).
wanted() {
  [ ${#only[@]} -eq 0 ] && return 0
  local short
  for short in "${only[@]}"; do [ "$short" = "$1" ] && return 0; done
  return 1
}

product_images() {
  local version short
  for short in "${only[@]}"; do
    case "$short" in
      operator | kvm-agent | kube-provider | squid-proxy) ;;
      *) echo "build-images: no product image '$short' (operator, kvm-agent, kube-provider, squid-proxy)" >&2; exit 2 ;;
    esac
  done
  version="$(awk '$1 == "appVersion:" { gsub(/"/, "", $2); print $2 }' "$here/../charts/egressproxy/Chart.yaml")"
  wanted operator && product_image operator operator.Dockerfile egressproxy-operator \
    "ghcr.io/egressproxy/egressproxy-operator:$version" RUNTIME_IMAGE "$DISTROLESS_BASE"
  wanted kvm-agent && product_image kvm-agent kvm-agent.Dockerfile kvm-agent \
    "ghcr.io/egressproxy/kvm-agent:$version" DEBIAN_IMAGE "$DEBIAN_BASE"
  wanted kube-provider && product_image kube-provider kube-provider.Dockerfile kube-provider \
    "ghcr.io/egressproxy/kube-provider:$version" RUNTIME_IMAGE "$DISTROLESS_BASE"
  wanted squid-proxy && proxy_image squid-proxy "ghcr.io/egressproxy/squid-proxy:$version" \
    DEBIAN_IMAGE "$DEBIAN_BASE"
  return 0
}

# proxy_image SHORT NAME BASE_ARG BASE: deploy/docker/SHORT.Dockerfile with the files of
# deploy/docker/SHORT/ as its context (no binary of ours) and BASE as BASE_ARG.
proxy_image() {
  local short=$1 name=$2 base_arg=$3 base=$4
  if ! buildah_ inspect --type image "$base" >/dev/null 2>&1; then
    echo "build-images: the base $base is missing: run '$0 bases' (make setup does)" >&2
    exit 1
  fi
  local context="$work/$short-context"
  mkdir -p "$context"
  cp -r "$here/../deploy/docker/$short/." "$context/"
  cp "$here/../deploy/docker/$short.Dockerfile" "$context/Dockerfile"
  build_image "$short" "$name" "$context" \
    "$(buildah_ inspect --type image --format '{{.FromImageID}}' "$base")" \
    -f "$context/Dockerfile" --build-arg "$base_arg=$base"
}

case "$set_name" in
  cluster) cluster_images ;;
  bases) base_images ;;
  product)
    bindir="$(cd "$2" && pwd)"
    only=("${@:3}")
    product_images
    ;;
esac
echo "$images"
