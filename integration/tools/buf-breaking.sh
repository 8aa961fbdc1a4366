#!/usr/bin/env bash
# Runs `buf breaking` on the contract against the previous commit (HEAD~1), the check
# CI runs on every change to main, and against contract 1.0 (the commit that froze it):
# every 1.x version must stay wire- and source-compatible with 1.0, not only with the
# commit before it. Skips a comparison, saying so, when its commit is not in this clone
# (a shallow clone) or has no contract yet (the commit that introduced v1).
# Usage: integration/tools/buf-breaking.sh PATH_TO_BUF
set -euo pipefail
buf=${1:?usage: buf-breaking.sh PATH_TO_BUF}
contract=proto/egressproxy/provider/v1/provider.proto
# The last commit of contract 1.0.0 (proto/egressproxy/provider/v1/provider.proto as
# released); later 1.x versions only add to it.
v1_0=fb4f0d88cc6c4d9896802dc539a1e210706530df

against() {
  local name=$1 ref=$2
  if ! git rev-parse -q --verify "$ref^{commit}" >/dev/null; then
    echo "buf-breaking: $name ($ref) is not in this clone (shallow?); fetch the full history to compare"
    return 0
  fi
  if ! git cat-file -e "$ref:$contract" 2>/dev/null || ! git cat-file -e "$ref:buf.yaml" 2>/dev/null; then
    echo "buf-breaking: $name has no contract yet; nothing to compare against"
    return 0
  fi
  "$buf" breaking --against ".git#ref=$ref"
  echo "buf-breaking: no breaking change against $name"
}

if git rev-parse -q --verify HEAD~1 >/dev/null; then
  against "HEAD~1" "$(git rev-parse HEAD~1)"
else
  echo "buf-breaking: no previous commit; nothing to compare against"
fi
against "contract 1.0" "$v1_0"
