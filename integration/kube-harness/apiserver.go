package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/pflag"
	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	basecompatibility "k8s.io/component-base/compatibility"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
	"k8s.io/kubernetes/cmd/kube-apiserver/app/options"
)

const apiserverStopTimeout = 20 * time.Second

// serviceAccountIssuer is the issuer a kubeadm cluster uses.
const serviceAccountIssuer = "https://kubernetes.default.svc.cluster.local"

// admissionPlugins are enabled on top of kube-apiserver's default set (NamespaceLifecycle,
// LimitRanger, ServiceAccount, PodSecurity, ResourceQuota, the webhook and policy
// plugins and the rest), as kubeadm does.
const admissionPlugins = "NodeRestriction"

type apiserverConfig struct {
	listener    net.Listener
	etcdURL     string
	pki         pkiFiles
	verbosity   int
	runtimeRoot string
}

// runningAPIServer is kube-apiserver running in this process.
type runningAPIServer struct {
	cancel context.CancelFunc
	// done receives the error Run returned; it is closed once Run has returned.
	done <-chan error
}

// apiserverFlags are the command-line flags of a kubeadm-like single control-plane node.
func apiserverFlags(c apiserverConfig) []string {
	return []string{
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		// The endpoint reconciler would publish 127.0.0.1 as the "kubernetes" Service's
		// endpoint, which validation rejects; nothing in-cluster dials it here.
		"--endpoint-reconciler-type=none",
		"--etcd-servers=" + c.etcdURL,
		"--tls-cert-file=" + c.pki.servingCert,
		"--tls-private-key-file=" + c.pki.servingKey,
		"--client-ca-file=" + c.pki.caCert,
		"--service-account-issuer=" + serviceAccountIssuer,
		"--service-account-key-file=" + c.pki.serviceAccountPub,
		"--service-account-signing-key-file=" + c.pki.serviceAccountKey,
		"--authorization-mode=Node,RBAC",
		"--enable-admission-plugins=" + admissionPlugins,
		"--service-cluster-ip-range=" + serviceClusterIPRange,
		"--allow-privileged=true",
		"--cert-dir=" + filepath.Join(c.runtimeRoot, "certs"),
		"--profiling=false",
	}
}

func startAPIServer(parent context.Context, c apiserverConfig) (*runningAPIServer, error) {
	s := options.NewServerRunOptions()
	featureGate := s.GenericServerRunOptions.ComponentGlobalsRegistry.FeatureGateFor(basecompatibility.DefaultKubeComponent)

	fs := pflag.NewFlagSet("kube-apiserver", pflag.ContinueOnError)
	for _, named := range s.Flags().FlagSets {
		fs.AddFlagSet(named)
	}
	if err := fs.Parse(apiserverFlags(c)); err != nil {
		return nil, fmt.Errorf("kube-apiserver flags: %v", err)
	}
	s.SecureServing.Listener = c.listener
	s.SecureServing.BindPort = c.listener.Addr().(*net.TCPAddr).Port
	s.Logs.Verbosity = logsapi.VerbosityLevel(c.verbosity)

	if err := s.GenericServerRunOptions.ComponentGlobalsRegistry.Set(); err != nil {
		return nil, fmt.Errorf("kube-apiserver feature gates: %v", err)
	}
	if err := logsapi.ValidateAndApply(s.Logs, featureGate); err != nil {
		return nil, fmt.Errorf("kube-apiserver logging: %v", err)
	}

	ctx, cancel := context.WithCancel(parent)
	completed, err := s.Complete(ctx)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("kube-apiserver options: %v", err)
	}
	if errs := completed.Validate(); len(errs) != 0 {
		cancel()
		return nil, fmt.Errorf("kube-apiserver options: %v", utilerrors.NewAggregate(errs))
	}

	done := make(chan error, 1)
	go func() {
		defer close(done)
		done <- app.Run(ctx, completed)
	}()
	return &runningAPIServer{cancel: cancel, done: done}, nil
}

// stop cancels the apiserver and waits (bounded) for it to drain.
func (a *runningAPIServer) stop() {
	a.cancel()
	select {
	case <-a.done:
	case <-time.After(apiserverStopTimeout):
		fmt.Fprintf(os.Stderr, "kube-harness: kube-apiserver did not stop within %s; exiting anyway\n", apiserverStopTimeout)
	}
	klog.Flush()
}
