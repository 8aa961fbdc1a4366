#!/usr/bin/env bash
# The root filesystem of the stand-in for gcr.io/distroless/cc-debian12:nonroot: no shell
# and no package manager, only what a dynamically linked C or Rust program needs (glibc,
# libgcc, OpenSSL's libraries, CA certificates, time zones, /etc/services), and the
# users distroless has (root, nonroot 65532, nobody), unpacked from bookworm's packages
# as distroless itself is.
#
# Usage (as root): distroless-cc.sh ROOTFS MIRROR DEBS_CACHE
set -euo pipefail
root=$1 debs=$3
packages=(base-files netbase tzdata libc6 libgcc-s1 libssl3 ca-certificates)
mkdir -p "$root" "$debs"
(cd "$debs" && apt-get download -q -o APT::Sandbox::User=root "${packages[@]}" >/dev/null) \
  || { echo "distroless-cc: 'apt-get download ${packages[*]}' failed: run apt-get update (integration/tools/install-system-packages.sh does)" >&2; exit 1; }
for package in "${packages[@]}"; do
  deb=$(ls -t "$debs/${package}"_*.deb | head -n1)
  dpkg-deb -x "$deb" "$root"
done
# What ca-certificates' postinst would assemble.
mkdir -p "$root/etc/ssl/certs"
cat "$root"/usr/share/ca-certificates/mozilla/*.crt >"$root/etc/ssl/certs/ca-certificates.crt"
cat >"$root/etc/passwd" <<'USERS'
root:x:0:0:root:/root:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
USERS
cat >"$root/etc/group" <<'GROUPS'
root:x:0:
nobody:x:65534:
nonroot:x:65532:
GROUPS
install -d -m 0700 "$root/root"
install -d -m 0700 -o 65532 -g 65532 "$root/home/nonroot"
install -d -m 1777 "$root/tmp"
rm -rf "$root/usr/share/doc" "$root/usr/share/man" "$root/usr/share/lintian"
