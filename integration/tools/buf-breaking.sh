#!/usr/bin/env bash
# Runs `buf breaking` on the contract against the previous commit (HEAD~1), the check
# CI runs on every change to main. Skips, saying so, when there is no previous commit
# or it has no contract yet (the commit that introduced v1).
# Usage: integration/tools/buf-breaking.sh PATH_TO_BUF
set -euo pipefail
buf=${1:?usage: buf-breaking.sh PATH_TO_BUF}
contract=proto/egressproxy/provider/v1/provider.proto
if ! git rev-parse -q --verify HEAD~1 >/dev/null; then
  echo "buf-breaking: no previous commit; nothing to compare against"
  exit 0
fi
if ! git cat-file -e "HEAD~1:$contract" 2>/dev/null || ! git cat-file -e HEAD~1:buf.yaml 2>/dev/null; then
  echo "buf-breaking: HEAD~1 has no contract yet; nothing to compare against"
  exit 0
fi
"$buf" breaking --against ".git#ref=HEAD~1"
echo "buf-breaking: no breaking change against HEAD~1"
