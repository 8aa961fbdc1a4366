# syntax=docker/dockerfile:1
# The proxy image kube-provider runs by default: Debian's squid, the proxy the VMs of
# kvm-agent run too (integration/guest-image/), configured for a pod. Build from the
# repository root:
#   docker build -f deploy/docker/squid-proxy.Dockerfile -t squid-proxy deploy/docker/squid-proxy
#
# A pod has no cloud-init, so the image carries the proxy's configuration
# (squid-proxy/squid.conf) and takes the one per-instance setting, the port, from the
# environment variable kube-provider sets (PROXY_PORT, see deploy/kube-provider/config.yaml).
# It runs as uid 65532 and writes nothing to disk: no cache directory, no pid file, the
# access log on stdout and the cache log on stderr, so a read-only root filesystem works.
#
# The base is a build argument (default: the public image) for machines that make their
# own (docs/adr/0017-images-built-with-buildah-from-local-bases.md).
ARG DEBIAN_IMAGE=docker.io/library/debian:bookworm-slim

FROM ${DEBIAN_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends squid=5.7-* \
    && rm -rf /var/lib/apt/lists/* /etc/squid/conf.d/* \
    && groupadd --system --gid 65532 proxy-user \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin proxy-user
COPY squid.conf /etc/squid/pod.conf
COPY entrypoint.sh /usr/local/bin/squid-proxy
ENV PROXY_PORT=3128
USER 65532:65532
EXPOSE 3128
ENTRYPOINT ["/usr/local/bin/squid-proxy"]
