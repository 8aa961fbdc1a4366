#!/usr/bin/env bash
# Builds the container images the in-cluster tests run, with buildah (daemonless, from
# Debian's packages), and writes each as a docker-archive that the test cluster's
# containerd imports (`ctr images import`). Nothing can be pulled from a registry here,
# so every image starts from `scratch` or from a base made here from Debian's packages.
#
# Usage: integration/tools/build-images.sh cluster   # the cluster's own images (make setup)
#
#   cluster: pause (the pod sandbox, Kubernetes' pause.c compiled statically), coredns
#            (the binary integration/tools/install-go-tools.sh builds) and toolbox
#            (Debian's busybox-static, for test pods). Needs kube-node and coredns built.
#
# Each image is keyed on a hash of its Containerfile and inputs: a warm run finds every
# archive at its key and builds nothing. Prints the images directory.
# Env:   EGRESSPROXY_TOOLS_DIR  cache directory (default: $XDG_CACHE_HOME/egressproxy/tools)
set -euo pipefail

cache="${EGRESSPROXY_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/egressproxy/tools}"
bin="$cache/bin"
images="$cache/images"
storage="$cache/containers"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$images" "$storage"

if [ $# -ne 1 ] || [ "$1" != cluster ]; then
  echo "usage: $0 cluster" >&2
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

# build_image SHORT NAME CONTEXT: builds CONTEXT/Containerfile as NAME and writes
# $images/SHORT.tar, unless $images/SHORT.key already holds the hash of the context.
build_image() {
  local short=$1 name=$2 context=$3
  local key
  key="$(cd "$context" && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)"
  if [ -f "$images/$short.tar" ] && [ "$(cat "$images/$short.key" 2>/dev/null)" = "$key" ]; then
    return 0
  fi
  echo "build-images: building $name" >&2
  if ! buildah_ bud --quiet --isolation chroot --pull-never --layers -t "$name" -f "$context/Containerfile" "$context" >&2; then
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

echo "$images"
