# syntax=docker/dockerfile:1
# The egressproxy operator. Build from the repository root:
#   docker build -f deploy/docker/operator.Dockerfile -t egressproxy-operator .
#
# Stage 1 compiles the release binary with the pinned toolchain (rust-toolchain.toml).
# Stage 2 is distroless: glibc, CA certificates, no shell, uid 65532 (nonroot). The
# operator links no C libraries beyond glibc (rustls with ring), so nothing else is needed.
#
# The base images are build arguments (defaults: the public images) for machines that
# make their own bases. The runtime stage copies the binary from the `binaries` stage; a
# builder with named build contexts can give it a binary built elsewhere instead, as the
# project's tests do (buildah: `--build-context binaries=DIR`, with DIR/out/ holding it;
# see docs/adr/0017-images-built-with-buildah-from-local-bases.md).
ARG RUST_IMAGE=docker.io/library/rust:1.95.0-slim-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p egressproxy-operator --bin egressproxy-operator \
    && install -D -m 0755 target/release/egressproxy-operator /out/egressproxy-operator

FROM build AS binaries

FROM ${RUNTIME_IMAGE}
COPY --from=binaries /out/egressproxy-operator /usr/local/bin/egressproxy-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/egressproxy-operator"]
