#!/usr/bin/env bash
# The root filesystem of the stand-in for docker.io/library/debian:bookworm-slim: a
# minbase debootstrap of bookworm (apt, dpkg, bash and coreutils: what the Dockerfiles'
# RUN steps use), without apt's lists and package cache, as the official image ships.
#
# Usage (as root): debian-slim.sh ROOTFS MIRROR DEBS_CACHE
set -euo pipefail
root=$1 mirror=$2 debs=$3
mkdir -p "$debs"
debootstrap --variant=minbase --cache-dir="$debs" bookworm "$root" "$mirror" >"$root.log" 2>&1 \
  || { tail -n 30 "$root.log" >&2; exit 1; }
# The image's apt talks to the mirror named here; the Dockerfiles add backports beside it.
echo "deb $mirror bookworm main" >"$root/etc/apt/sources.list"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
  "$root"/var/log/*.log "$root"/var/log/apt/* "$root"/var/log/dpkg.log
