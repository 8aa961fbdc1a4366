// Command coredns is CoreDNS with only the plugins a test cluster's DNS needs: answers
// for Services and Pods from the Kubernetes API, health and readiness endpoints, a cache.
// Built from CoreDNS's own Go module with the plugin list set here instead of its
// plugin.cfg, so the cloud providers' DNS plugins (and their SDKs) are not compiled.
// Test tooling only: see docs/testing/kube-cluster.md.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// The plugins in the order CoreDNS's plugin.cfg chains them.
func init() {
	dnsserver.Directives = []string{"ready", "health", "errors", "log", "cache", "kubernetes"}
}

func main() {
	coremain.Run()
}
