#!/usr/bin/env bash
# The local end-to-end demo: starts the reference provider, then drives the Provider
# contract with the real grpcurl the way a user debugging a provider would, and runs
# the conformance suite against it. Stops the provider on exit.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bin="$(integration/tools/install-go-tools.sh grpcurl)"
grpcurl="$bin/grpcurl"

cargo build --quiet --locked -p egressproxy-provider --bins
log=$(mktemp)
target/debug/reference-provider --listen 127.0.0.1:0 --provisioning-delay 1s >"$log" 2>&1 &
provider=$!
trap 'kill $provider 2>/dev/null; wait $provider 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 50); do grep -q '^listening on ' "$log" && break; sleep 0.1; done
addr=$(sed -n 's/^listening on //p' "$log")
[ -n "$addr" ] || { echo "demo: the reference provider did not start:"; cat "$log"; exit 1; }

step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }
step "$grpcurl" -plaintext "$addr" list
step "$grpcurl" -plaintext "$addr" describe egressproxy.provider.v1.Provider.CreateInstance
step "$grpcurl" -plaintext "$addr" egressproxy.provider.v1.Provider/GetPluginInfo
create='{"key":"demo-1","name":"default/egress","tags":{"egressproxy.dev/cluster":"demo"},
         "placement":{"machineType":"small","image":"debian-12"},"proxyPort":3128}'
id=$(step "$grpcurl" -plaintext -d "$create" "$addr" egressproxy.provider.v1.Provider/CreateInstance \
  | tee /dev/stderr | sed -n 's/.*"id": "\(ref-[^"]*\)".*/\1/p' | head -1)
sleep 1.2
step "$grpcurl" -plaintext -d "{\"id\":\"$id\"}" "$addr" egressproxy.provider.v1.Provider/GetInstance
step "$grpcurl" -plaintext -d '{"tagSelector":{"egressproxy.dev/cluster":"demo"}}' "$addr" egressproxy.provider.v1.Provider/ListInstances
step "$grpcurl" -plaintext -d "{\"id\":\"$id\"}" "$addr" egressproxy.provider.v1.Provider/DeleteInstance
step target/debug/provider-conformance --endpoint "http://$addr" --machine-type small --image debian-12 --running-timeout 10s
echo; echo "demo: done"
