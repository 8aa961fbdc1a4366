# syntax=docker/dockerfile:1
# The egressproxy operator. Build from the repository root:
#   docker build -f deploy/docker/operator.Dockerfile -t egressproxy-operator .
#
# Stage 1 compiles the release binary with the pinned toolchain (rust-toolchain.toml).
# Stage 2 is distroless: glibc, CA certificates, no shell, uid 65532 (nonroot). The
# operator links no C libraries beyond glibc (rustls with ring), so nothing else is needed.
FROM docker.io/library/rust:1.95.0-slim-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p egressproxy-operator --bin egressproxy-operator \
    && install -D -m 0755 target/release/egressproxy-operator /out/egressproxy-operator

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/egressproxy-operator /usr/local/bin/egressproxy-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/egressproxy-operator"]
