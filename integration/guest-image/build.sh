#!/usr/bin/env bash
# Builds the end-to-end tests' guest image from Debian's packages and prints its path.
#
# The image boots like a cloud image: UEFI from its own disk (GPT, a FAT EFI system
# partition holding a standalone GRUB loader, an ext4 root), cloud-init reading a NoCloud
# seed, qemu-guest-agent for the address, squid allowing `localnet`, Debian's cloud
# kernel (virtio disk, virtio-scsi seed cdrom, virtio-net). Nothing is installed at boot:
# the guests of the tests have no internet.
#
# The result is cached by the hash of this directory (the recipe), so a warm run prints
# the cached path at once; a cold build takes about two minutes. Builds are serialised
# by a lock, so a test and `make demo` can ask at the same time.
#
# Usage (as root: debootstrap and chroot): integration/guest-image/build.sh
# Environment:
#   EGRESSPROXY_GUEST_IMAGE_CACHE  cache dir (default ~/.cache/egressproxy/guest-image)
#   EGRESSPROXY_DEBIAN_MIRROR      Debian mirror (default: the system's bookworm entry)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${EGRESSPROXY_GUEST_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/egressproxy/guest-image}
recipe_hash=$(cd "$here" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
image=$cache/$recipe_hash.qcow2

if [ -s "$image" ]; then
  echo "$image"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "guest-image: building needs root (debootstrap, chroot); no cached $image" >&2
  exit 1
fi
for tool in debootstrap mkfs.ext4 mkfs.vfat mmd mcopy sgdisk grub-mkimage qemu-img; do
  command -v "$tool" >/dev/null || {
    echo "guest-image: $tool is missing: run integration/tools/install-system-packages.sh" >&2
    exit 1
  }
done

mkdir -p "$cache/debs"
exec 9>"$cache/.lock"
flock 9
if [ -s "$image" ]; then # another build finished while this one waited
  echo "$image"
  exit 0
fi

mirror=${EGRESSPROXY_DEBIAN_MIRROR:-}
if [ -z "$mirror" ] && [ -f /etc/apt/sources.list.d/debian.sources ]; then
  mirror=$(awk '/^URIs:/ && !/security/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
fi
mirror=${mirror:-http://deb.debian.org/debian}

work=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root
started=$SECONDS
log() { echo "guest-image: $* ($((SECONDS - started)) s)" >&2; }

# The chroot steps run in a private mount namespace: /proc and the package cache are
# mounted there only, and vanish with it even when a step fails.
log "debootstrap bookworm (minbase) from $mirror"
debootstrap --variant=minbase --cache-dir="$cache/debs" bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 \
  || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }

# Services must not start inside the chroot; the packages' postinst scripts honour this.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod +x "$root/usr/sbin/policy-rc.d"

packages=(
  linux-image-cloud-amd64 systemd-sysv udev
  cloud-init cloud-guest-utils qemu-guest-agent squid
  ifupdown isc-dhcp-client iproute2 netbase procps
)
log "installing ${packages[*]}"
unshare --mount --propagation private bash -euo pipefail -c '
  root=$1 debs=$2; shift 2
  mount -t proc proc "$root/proc"
  mount --bind /dev "$root/dev"
  mount --bind "$debs" "$root/var/cache/apt/archives"
  chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
' _ "$root" "$cache/debs" "${packages[@]}" >"$work/install.log" 2>&1 \
  || { tail -n 30 "$work/install.log" >&2; exit 1; }
rm -f "$root/usr/sbin/policy-rc.d"

root_uuid=$(cat /proc/sys/kernel/random/uuid)
install -m 0644 "$here/files/cloud-init.cfg" "$root/etc/cloud/cloud.cfg.d/90-egressproxy.cfg"
install -m 0644 "$here/files/squid-localnet.conf" "$root/etc/squid/conf.d/egressproxy-localnet.conf"
sed "s/@ROOT_UUID@/$root_uuid/g" "$here/files/fstab" >"$root/etc/fstab"
# Each guest makes its own machine id (and so its own DHCP client id) on first boot.
: >"$root/etc/machine-id"
rm -f "$root/var/lib/dbus/machine-id"
echo egressproxy-guest >"$root/etc/hostname"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log

log "assembling the disk"
# GRUB as one standalone EFI binary at the removable-media path, so OVMF boots it
# without NVRAM entries, with its configuration embedded. GRUB's embedded configuration
# knows no comments (each prints "Unknown command" on the console), so they go.
sed -e "s/@ROOT_UUID@/$root_uuid/g" -e '/^#/d' "$here/files/grub-early.cfg" >"$work/grub-early.cfg"
grub-mkimage -O x86_64-efi -o "$work/BOOTX64.EFI" -p /EFI/BOOT -c "$work/grub-early.cfg" \
  part_gpt fat ext2 search search_fs_uuid linux boot echo normal configfile gzio efi_gop all_video

esp_mib=32
disk_mib=2048
root_mib=$((disk_mib - esp_mib - 2))
mkfs.vfat -C -n ESP "$work/esp.img" $((esp_mib * 1024)) >/dev/null
mmd -i "$work/esp.img" ::/EFI ::/EFI/BOOT
mcopy -i "$work/esp.img" "$work/BOOTX64.EFI" ::/EFI/BOOT/BOOTX64.EFI
mkfs.ext4 -q -d "$root" -U "$root_uuid" -L root "$work/root.img" "${root_mib}M" >/dev/null

truncate -s "${disk_mib}M" "$work/disk.raw"
sgdisk -o \
  -n "1:1MiB:+${esp_mib}MiB" -t 1:ef00 -c 1:ESP \
  -n "2:$((1 + esp_mib))MiB:+${root_mib}MiB" -t 2:8300 -c 2:root \
  "$work/disk.raw" >/dev/null
# sgdisk has been seen to exit 0 having written nothing: check the table.
partitions=$(sgdisk -p "$work/disk.raw" | grep -cE '^ +[12] ')
[ "$partitions" -eq 2 ] || { echo "guest-image: partition table not written" >&2; exit 1; }
dd if="$work/esp.img" of="$work/disk.raw" bs=1M seek=1 conv=notrunc,sparse status=none
dd if="$work/root.img" of="$work/disk.raw" bs=1M seek=$((1 + esp_mib)) conv=notrunc,sparse status=none

qemu-img convert -c -O qcow2 "$work/disk.raw" "$work/image.qcow2"
mv "$work/image.qcow2" "$image"
# Older builds of other recipes are no longer wanted.
find "$cache" -maxdepth 1 -name '*.qcow2' ! -name "$recipe_hash.qcow2" -delete
log "built $image ($(du -m "$image" | cut -f1) MiB)"
echo "$image"
