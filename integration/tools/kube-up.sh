#!/usr/bin/env bash
# Starts a real kube-apiserver (with etcd) on loopback for poking at by hand, prints its
# kubeconfig path, and runs until Ctrl-C, which stops it and removes everything it made.
#
# Usage: integration/tools/kube-up.sh [--port 6443] [-v 2] [--dir DIR --keep-dir]
#   then, in another shell: export KUBECONFIG=<the printed path>; kubectl get ns
# Tests use the same cluster when EGRESSPROXY_TEST_KUBECONFIG names that path.
set -euo pipefail

bin="$("$(dirname "${BASH_SOURCE[0]}")/install-go-tools.sh")"
exec "$bin/kube-harness" "$@"
