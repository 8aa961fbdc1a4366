#!/usr/bin/env bash
# `make ci`: every stage CI runs, in order, each timed. A table of the stages' wall times
# is printed at the end, also when a stage fails, so a slow or red run says where its
# time went.
#
# Three builds run side by side: the Go-built test tools (mostly the kube-apiserver),
# the Rust workspace and the end-to-end tests' guest image. Each leaves cores idle at
# times (module and package downloads, single-threaded links, dpkg), so together they
# take little more than the longest of the three.
#
# Usage: integration/tools/ci.sh        (from `make ci`, as root on a fresh machine)
# Env:   CI_STAGE_TIMES  also write the table (tab-separated) to this file
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# A one-off build gains nothing from the incremental cache, which would add gigabytes to
# a disk that has to hold the build, the images and the tests' guests.
export CARGO_INCREMENTAL=0

times=$(mktemp)
logs=$(mktemp -d)
run_start=$SECONDS

report() {
  local rc=$?
  {
    echo
    echo "ci stages (wall time):"
    printf '  %-16s %8s  %s\n' stage seconds result
    while IFS=$'\t' read -r name seconds status; do
      printf '  %-16s %8s  %s\n' "$name" "$seconds" "$([ "$status" = 0 ] && echo ok || echo "FAILED ($status)")"
    done <"$times"
    printf '  %-16s %8s\n' total $((SECONDS - run_start))
    # A full disk fails a build or a test with a message far from its cause.
    if [ "$rc" -ne 0 ]; then df -h . /tmp 2>/dev/null || true; fi
    # A failed test's message is far up a long log, and often only the end of a log is
    # kept: repeat each failure's first lines last.
    if [ "$rc" -ne 0 ] && [ -s "$logs/test.log" ]; then failure_digest "$logs/test.log"; fi
  } >&2
  if [ -n "${CI_STAGE_TIMES:-}" ]; then cp "$times" "$CI_STAGE_TIMES"; fi
  rm -rf "$times" "$logs"
  exit "$rc"
}
trap report EXIT

# failure_digest LOG: the first lines of each failed test's panic in a `cargo test` log,
# and each test binary that died without one, at most 30 lines.
failure_digest() {
  echo
  echo "test failures (first lines; the whole output is above):"
  awk '
    /^---- .* stdout ----$/ { name = $2; next }
    /panicked at/ { left = 6; print "  " name ": " substr($0, 1, 240); next }
    left > 0 {
      if ($0 == "" || $0 ~ /^note: run with/) { left = 0; next }
      print "    " substr($0, 1, 240); left--
    }
    /process didn.t exit successfully/ { print "  " substr($0, 1, 240) }
  ' "$1" | head -n 30
}

# stage NAME COMMAND...: runs COMMAND and records its wall time and exit status.
stage() {
  local name=$1
  shift
  local start=$SECONDS status=0
  echo "==> ci: $name" >&2
  "$@" || status=$?
  printf '%s\t%s\t%s\n' "$name" $((SECONDS - start)) "$status" >>"$times"
  return "$status"
}

stage setup-system make setup-system

# The tools and the guest image build in the background with their output kept aside,
# printed once the workspace build is done, so the logs do not interleave.
(stage setup-tools make setup-tools >"$logs/setup-tools.log" 2>&1) &
tools=$!
(stage guest-image make guest-image >"$logs/guest-image.log" 2>&1) &
image=$!
failed=0
stage build cargo build --workspace --all-targets --locked || failed=1
wait "$tools" || failed=1
cat "$logs/setup-tools.log" >&2
wait "$image" || failed=1
cat "$logs/guest-image.log" >&2
if [ "$failed" -ne 0 ]; then
  exit 1
fi

stage fmt-check make fmt-check
stage lint make lint
stage breaking make breaking
stage generate-check make generate-check
stage test bash -o pipefail -c 'make test 2>&1 | tee "$1"' test "$logs/test.log"
