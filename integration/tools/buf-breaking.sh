#!/usr/bin/env bash
# Runs `buf breaking` on the contract against contract 1.0 and against the previous
# commit (HEAD~1), the checks CI runs on every change to main: every 1.x version must
# stay wire- and source-compatible with 1.0, not only with the commit before it.
#
# 1.0 is kept in the tree (integration/contract-1.0/), so that comparison runs in every
# clone; where the clone has the commit that froze it, the copy is checked against it.
# HEAD~1 comes from git: in a shallow clone the script fetches one more commit from the
# origin; where it still cannot (no origin, no network) it warns on stderr and compares
# against 1.0 alone, or fails when BUF_BREAKING_NEEDS_PARENT=1 (for a CI that must never
# skip it).
# Usage: integration/tools/buf-breaking.sh PATH_TO_BUF
set -euo pipefail
buf=${1:?usage: buf-breaking.sh PATH_TO_BUF}
released=integration/contract-1.0
# The last commit of contract 1.0.0 (the proto module as released); later 1.x versions
# only add to it.
v1_0=fb4f0d88cc6c4d9896802dc539a1e210706530df

# The in-tree copy must be what was released: compare it file by file where git can.
if git rev-parse -q --verify "$v1_0^{commit}" >/dev/null; then
  for file in $(git ls-tree -r --name-only "$v1_0" proto/egressproxy); do
    if ! git show "$v1_0:$file" | cmp -s - "$released/$file"; then
      echo "buf-breaking: $released/$file differs from $file at $v1_0 (contract 1.0): restore it with" >&2
      echo "  git show $v1_0:$file > $released/$file" >&2
      exit 1
    fi
  done
fi
"$buf" breaking --against "$released"
echo "buf-breaking: no breaking change against contract 1.0"

if ! git rev-parse -q --verify HEAD~1 >/dev/null &&
  [ "$(git rev-parse --is-shallow-repository)" = true ] &&
  git remote get-url origin >/dev/null 2>&1; then
  git fetch -q --deepen=1 origin || true
fi
if git rev-parse -q --verify HEAD~1 >/dev/null; then
  parent=$(git rev-parse HEAD~1)
  if git cat-file -e "$parent:buf.yaml" 2>/dev/null; then
    "$buf" breaking --against ".git#ref=$parent"
    echo "buf-breaking: no breaking change against HEAD~1"
  else
    echo "buf-breaking: HEAD~1 has no contract yet; nothing to compare against"
  fi
elif [ "$(git rev-parse --is-shallow-repository)" != true ]; then
  echo "buf-breaking: HEAD is the first commit; nothing to compare against"
else
  echo "buf-breaking: WARNING: HEAD~1 is not in this shallow clone and could not be fetched; compared against contract 1.0 only. Run \`git fetch --deepen=1\` to compare against it too." >&2
  if [ "${BUF_BREAKING_NEEDS_PARENT:-}" = 1 ]; then exit 1; fi
fi
