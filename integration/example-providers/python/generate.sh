#!/usr/bin/env bash
# Generates the Python code of the Provider contract from proto/ with grpcio-tools
# (its bundled protoc: no system protoc, no network). Works on a fresh machine after
# integration/tools/install-python-tools.sh.
#
# Usage: generate.sh OUT_DIR [PYTHON]   # PYTHON: a python with grpcio-tools
set -euo pipefail
out=${1:?usage: generate.sh OUT_DIR [PYTHON]}
python=${2:-python3}
repo=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$out"
"$python" -m grpc_tools.protoc -I "$repo/proto" \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  egressproxy/provider/v1/provider.proto
