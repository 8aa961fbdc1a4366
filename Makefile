# One task runner for the project. `make ci` is what CI runs (.ci/run) and what the
# README tells newcomers to run; `make demo` is the local end-to-end demo.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
TOOLS_DIR ?= $(or $(EGRESSPROXY_TOOLS_DIR),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/egressproxy/tools)
TOOLS_BIN := $(TOOLS_DIR)/bin
BUF := $(TOOLS_BIN)/buf
HELM := $(TOOLS_BIN)/helm
HADOLINT := $(TOOLS_BIN)/hadolint
CHART := charts/egressproxy

.PHONY: kube-up ci setup setup-system setup-tools fmt fmt-check lint clippy doc-check buf-lint chart-lint dockerfile-lint breaking generate generate-check test churn-short images demo demo-down demo-reference e2e faults guest-image bench fuzz

## ci: set up the machine, then every check and test (what .ci/run runs), each stage
## timed; the Go tools and the Rust workspace build side by side
ci:
	integration/tools/ci.sh

## setup: install system packages (root), build the pinned Go test tools and the test
## cluster's images, make the Python venv
setup: setup-system setup-tools

setup-system:
	@if [ "$$(id -u)" -eq 0 ]; then integration/tools/install-system-packages.sh; \
	else echo "setup-system: not root, skipping apt packages (run as root on a fresh machine)"; fi

setup-tools:
	integration/tools/install-go-tools.sh
	integration/tools/install-hadolint.sh
	integration/tools/install-python-tools.sh
	@if [ "$$(id -u)" -eq 0 ]; then integration/tools/build-images.sh cluster && integration/tools/build-images.sh bases; \
	else echo "setup-tools: not root, skipping the test cluster's images (buildah needs root)"; fi

## fmt: format Rust code and proto files
fmt:
	cargo fmt --all
	$(BUF) format -w

fmt-check:
	cargo fmt --all --check
	$(BUF) format --diff --exit-code

## lint: clippy and rustdoc with warnings as errors, buf lint, helm lint, hadolint
lint: clippy doc-check buf-lint chart-lint dockerfile-lint

clippy:
	cargo clippy --workspace --all-targets --locked -- -D warnings

## doc-check: API docs build without broken or private intra-doc links
doc-check:
	RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

buf-lint:
	$(BUF) lint

## chart-lint: helm lint of the chart with its default values and every example
chart-lint:
	$(HELM) lint --strict $(CHART)
	for values in $(CHART)/examples/*.yaml; do $(HELM) lint --strict $(CHART) -f "$$values"; done

## dockerfile-lint: hadolint on every Dockerfile (no container engine runs in CI)
dockerfile-lint:
	$(HADOLINT) deploy/docker/*.Dockerfile

## breaking: buf breaking against the previous commit of main and against contract 1.0
breaking:
	integration/tools/buf-breaking.sh "$(BUF)"

CRD := charts/egressproxy/files/crds.yaml
## generate: regenerate checked-in generated files (the CRD from the operator's types,
## the chart README's values table); generate-check fails on drift. The build is the one
## `make test` does (same feature set, so nothing builds twice), and files are replaced
## only when they change: tests include them, and a new mtime alone would make cargo
## rebuild those tests.
generate:
	cargo build --workspace --all-targets --locked
	target/debug/crdgen > $(CRD).new
	@if cmp -s $(CRD).new $(CRD); then rm $(CRD).new; else mv $(CRD).new $(CRD); fi
	integration/tools/chart-values-table.py $(CHART)

generate-check: generate
	@git diff --exit-code -- proto $(CRD) $(CHART)/README.md || { echo "generated files drifted: run 'make generate' and commit the result"; exit 1; }

## test: build every binary the tests spawn, then run every test (one build of every
## target, so the binaries and the tests share one feature set and nothing builds twice)
test:
	cargo build --workspace --all-targets --locked
	@if [ "$$(id -u)" -eq 0 ]; then integration/tools/build-images.sh product target/debug >/dev/null; \
	else echo "test: not root, skipping the images (buildah needs root): the in-cluster tests will fail"; fi
	cargo test --workspace --locked --no-fail-fast
	$(MAKE) --no-print-directory churn-short

## churn-short: the churn benchmark's short form on the debug build (7 waves of 30
## Proxies), part of `make test`, so a per-Proxy entry that outlives its Proxy fails CI;
## the long form is in `make bench`
churn-short:
	CHURN_WAVES=7 CHURN_WAVE_SIZE=30 CHURN_FLAT_WITHIN=0.25 RUST_LOG=warn \
		cargo test --locked -p egressproxy-operator --bench churn

## images: the operator's, the agent's, kube-provider's and the squid proxy's images from
## deploy/docker/ with buildah (the runtime stages, given the binaries cargo builds in
## PROFILE, debug or release), into the tools cache, where the test cluster imports them;
## cached by their inputs
PROFILE ?= debug
images:
	cargo build --locked -p egressproxy-operator -p kvm-agent -p kube-provider --bins $(if $(filter release,$(PROFILE)),--release,)
	integration/tools/build-images.sh product target/$(PROFILE)

## fuzz: the hostile-input property tests, run long (FUZZ_CASES cases each; `make test`
## runs the same tests with a small default, about a minute in all)
FUZZ_CASES ?= 100000
fuzz:
	cargo build --workspace --bins --locked
	PROPTEST_CASES=$(FUZZ_CASES) cargo test --locked -p egressproxy-provider --test hostile_requests
	PROPTEST_CASES=$(FUZZ_CASES) cargo test --locked -p kvm-agent --lib -- guest::iso9660::properties libvirt::xml::volume
	PROPTEST_CASES=$(FUZZ_CASES) cargo test --locked -p kvm-agent \
		--test hostile_libvirt_xml --test hostile_user_data --test hostile_config

## demo: the real path left running: a Proxy becomes a VM that proxies (see README)
demo: setup
	integration/tools/demo-up.sh

## demo-down: stop the demo and remove everything it made
demo-down:
	integration/tools/demo-down.sh

## demo-reference: the reference provider driven by grpcurl
demo-reference:
	integration/tools/demo-reference.sh

## e2e: the end-to-end test alone (a Proxy becomes a VM; builds the guest image if needed)
e2e:
	cargo build --workspace --bins --locked
	cargo test -p egressproxy-integration --test e2e_proxy --locked

## faults: the fault matrix on the real path alone; prints a table (case, injected,
## time to converge, leaks)
faults:
	cargo build --workspace --bins --locked
	cargo test -p egressproxy-integration --test e2e_faults --locked -- --nocapture

## guest-image: build (or find cached) the end-to-end tests' guest image; prints its path
guest-image:
	integration/guest-image/build.sh

## kube-up: a real kube-apiserver to poke at by hand (prints the kubeconfig path)
kube-up: setup-tools
	integration/tools/kube-up.sh

## bench: benchmarks that print figures beside their baselines
bench:
	cargo build --release --workspace --bins --locked
	RUST_LOG=warn cargo bench --workspace --locked
	RUST_LOG=warn cargo bench -p egressproxy-integration --bench apply_to_ready --locked -- --reference
