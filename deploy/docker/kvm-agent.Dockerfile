# syntax=docker/dockerfile:1
# The kvm-agent Provider. Build from the repository root:
#   docker build -f deploy/docker/kvm-agent.Dockerfile -t kvm-agent .
#
# Not a static binary: the agent calls libvirt through the `virt` crate, which links
# libvirt's C client library. Debian ships it only as a shared library (libvirt0, no
# libvirt.a), and it pulls in glib, gnutls, libxml2 and more at run time. So the build
# stage compiles against libvirt-dev and the runtime stage installs libvirt0, both from
# bookworm-backports (libvirt 11.3, the version the agent is tested with).
#
# The base images are build arguments (defaults: the public images) for machines that
# make their own bases. The runtime stage copies the binary from the `binaries` stage; a
# builder with named build contexts can give it a binary built elsewhere instead, as the
# project's tests do (buildah: `--build-context binaries=DIR`, with DIR/out/ holding it;
# see docs/adr/0017-images-built-with-buildah-from-local-bases.md).
ARG RUST_IMAGE=docker.io/library/rust:1.95.0-slim-bookworm
ARG DEBIAN_IMAGE=docker.io/library/debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
RUN echo 'deb http://deb.debian.org/debian bookworm-backports main' \
      > /etc/apt/sources.list.d/backports.list \
    && apt-get update \
    && apt-get install -y --no-install-recommends -t bookworm-backports libvirt-dev=11.3.* \
    && apt-get install -y --no-install-recommends pkg-config=1.8.* \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kvm-agent --bin kvm-agent \
    && install -D -m 0755 target/release/kvm-agent /out/kvm-agent

FROM build AS binaries

FROM ${DEBIAN_IMAGE}
# libvirt0: the shared client library (above). ca-certificates: image downloads over https.
RUN echo 'deb http://deb.debian.org/debian bookworm-backports main' \
      > /etc/apt/sources.list.d/backports.list \
    && apt-get update \
    && apt-get install -y --no-install-recommends -t bookworm-backports libvirt0=11.3.* \
    && apt-get install -y --no-install-recommends ca-certificates=20230311* \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 65532 kvm-agent \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin kvm-agent \
    && install -d -o 65532 -g 65532 -m 0700 /var/spool/kvm-agent /run/kvm-agent
COPY --from=binaries /out/kvm-agent /usr/local/bin/kvm-agent
# Writable only through the chart's emptyDir mounts (read-only root filesystem).
ENV TMPDIR=/var/spool/kvm-agent KVM_AGENT_RUNTIME_DIR=/run/kvm-agent
USER 65532:65532
EXPOSE 50051
ENTRYPOINT ["/usr/local/bin/kvm-agent"]
CMD ["serve", "--config", "/etc/kvm-agent/config.yaml", "--listen", "0.0.0.0:50051"]
