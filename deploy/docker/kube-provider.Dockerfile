# syntax=docker/dockerfile:1
# The kube-provider Provider (proxies as pods on egress nodes). Build from the
# repository root:
#   docker build -f deploy/docker/kube-provider.Dockerfile -t kube-provider .
#
# Stage 1 compiles the release binary with the pinned toolchain (rust-toolchain.toml).
# Stage 2 is distroless: glibc, CA certificates, no shell, uid 65532 (nonroot). Like the
# operator, the provider links no C library beyond glibc (rustls with ring) and reaches
# the apiserver as its pod's ServiceAccount (deploy/kube-provider/rbac.yaml).
#
# The base images are build arguments (defaults: the public images) for machines that
# make their own bases. The runtime stage copies the binary from the `binaries` stage; a
# builder with named build contexts can give it a binary built elsewhere instead
# (buildah: `--build-context binaries=DIR`, with DIR/out/ holding it; see
# docs/adr/0017-images-built-with-buildah-from-local-bases.md).
ARG RUST_IMAGE=docker.io/library/rust:1.95.0-slim-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kube-provider --bin kube-provider \
    && install -D -m 0755 target/release/kube-provider /out/kube-provider

FROM build AS binaries

FROM ${RUNTIME_IMAGE}
COPY --from=binaries /out/kube-provider /usr/local/bin/kube-provider
USER 65532:65532
EXPOSE 50051
ENTRYPOINT ["/usr/local/bin/kube-provider"]
