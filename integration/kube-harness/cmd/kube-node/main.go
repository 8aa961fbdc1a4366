// Command kube-node runs the components of a Kubernetes node and of the control plane
// beside kube-apiserver, built from the same k8s.io/kubernetes module as kube-harness:
//
//	kube-node kubelet ...                  (the kubelet's own flags)
//	kube-node kube-proxy ...
//	kube-node kube-scheduler ...
//	kube-node kube-controller-manager ...
//
// One binary with the four upstream commands (as hyperkube was) instead of four: they
// share one download, one build and one link. Each subcommand is the upstream command
// itself, with its flags and behaviour unchanged. Test tooling only: see
// docs/testing/kube-cluster.md.
package main

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strings"
	_ "time/tzdata" // the controller manager's CronJob time zones, as upstream's main has it

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

var components = map[string]func() *cobra.Command{
	"kubelet":                 func() *cobra.Command { return kubelet.NewKubeletCommand(context.Background()) },
	"kube-proxy":              proxy.NewProxyCommand,
	"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
	"kube-controller-manager": controllermanager.NewControllerManagerCommand,
}

func main() {
	if len(os.Args) < 2 || components[os.Args[1]] == nil {
		names := make([]string, 0, len(components))
		for name := range components {
			names = append(names, name)
		}
		sort.Strings(names)
		fmt.Fprintf(os.Stderr, "usage: kube-node COMPONENT [FLAGS...]: COMPONENT is one of %s\n", strings.Join(names, ", "))
		os.Exit(2)
	}
	command := components[os.Args[1]]()
	command.SetArgs(os.Args[2:])
	os.Exit(cli.Run(command))
}
