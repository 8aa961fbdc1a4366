// Command kube-harness runs a real kube-apiserver (built from k8s.io/kubernetes) on an
// embedded etcd, both on loopback, for tests and for poking at by hand.
//
// Flow:
//  1. Make a private directory (or use --dir), generate a CA, serving and client
//     certificates and a service-account signing key in it.
//  2. Bind the apiserver's port first (--port, 0 = any free port) so a port in use is
//     reported before anything heavy starts.
//  3. Start etcd embedded in this process on free loopback ports.
//  4. Start kube-apiserver in this process with RBAC, the usual admission plugins and
//     service-account tokens, wait for /readyz, write an admin kubeconfig.
//  5. Print one JSON line on stdout: {"ready":true,"kubeconfig":...,"server":...,"dir":...}.
//  6. Run until SIGINT/SIGTERM (or stdin EOF with --exit-on-stdin-eof), stop the
//     apiserver and etcd, and remove the directory it made.
//
// Every failure is one line on stderr that says what to do, and exit status 1.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"k8s.io/component-base/version"
)

type harnessOptions struct {
	port           int
	dir            string
	keepDir        bool
	exitOnStdinEOF bool
	readyTimeout   time.Duration
	verbosity      int
}

func parseFlags() harnessOptions {
	var o harnessOptions
	flag.IntVar(&o.port, "port", 0, "loopback port for the apiserver (0: any free port)")
	flag.StringVar(&o.dir, "dir", "", "directory for certificates, etcd data and the kubeconfig (default: a new temporary directory, removed on exit)")
	flag.BoolVar(&o.keepDir, "keep-dir", false, "keep the directory on exit")
	flag.BoolVar(&o.exitOnStdinEOF, "exit-on-stdin-eof", false, "also stop when stdin reaches end of file (so the harness dies with the process that holds its stdin)")
	flag.DurationVar(&o.readyTimeout, "ready-timeout", 2*time.Minute, "how long to wait for the apiserver to become ready")
	flag.IntVar(&o.verbosity, "v", 0, "apiserver log verbosity (klog -v)")
	flag.Parse()
	return o
}

func main() {
	// The harness's stdout and stderr are often pipes read by the process that started
	// it; once that process is gone, a log line must not kill the harness with SIGPIPE
	// before it has stopped etcd and removed its directory.
	signal.Ignore(syscall.SIGPIPE)
	if err := run(parseFlags()); err != nil {
		fmt.Fprintf(os.Stderr, "kube-harness: %v\n", err)
		os.Exit(1)
	}
}

func run(o harnessOptions) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if o.exitOnStdinEOF {
		ctx = cancelOnStdinEOF(ctx)
	}

	dir, removeDir, err := workDir(o.dir, o.keepDir)
	if err != nil {
		return err
	}
	defer removeDir()

	listener, err := listenLoopback(o.port)
	if err != nil {
		return err
	}
	pki, err := writePKI(dir)
	if err != nil {
		listener.Close()
		return err
	}

	etcd, err := startEtcd(dir)
	if err != nil {
		listener.Close()
		return err
	}
	defer etcd.stop()

	apiserver, err := startAPIServer(ctx, apiserverConfig{
		listener:    listener,
		etcdURL:     etcd.clientURL,
		pki:         pki,
		verbosity:   o.verbosity,
		runtimeRoot: dir,
	})
	if err != nil {
		return err
	}
	defer apiserver.stop()

	server := fmt.Sprintf("https://%s", listener.Addr().String())
	if err := waitReady(ctx, server, pki, o.readyTimeout, apiserver.done, etcd.errs); err != nil {
		return err
	}
	kubeconfig, err := writeKubeconfig(dir, server, pki)
	if err != nil {
		return err
	}
	if err := announceReady(readiness{Ready: true, Kubeconfig: kubeconfig, Server: server, Dir: dir, PID: os.Getpid()}); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "kube-harness: kube-apiserver %s is ready at %s\nkube-harness:   export KUBECONFIG=%s\nkube-harness: stop it with Ctrl-C or SIGTERM; that also removes %s\n",
		version.Get().GitVersion, server, kubeconfig, dir)

	select {
	case <-ctx.Done():
		return nil
	case err := <-apiserver.done:
		return fmt.Errorf("kube-apiserver stopped on its own: %v", err)
	case err := <-etcd.errs:
		return fmt.Errorf("etcd failed: %v", err)
	}
}

func workDir(dir string, keep bool) (string, func(), error) {
	if dir != "" {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return "", nil, fmt.Errorf("cannot create --dir %s: %v", dir, err)
		}
		if keep {
			return dir, func() {}, nil
		}
		return dir, func() { removeAll(dir) }, nil
	}
	made, err := os.MkdirTemp("", "kube-harness-")
	if err != nil {
		return "", nil, fmt.Errorf("cannot create a temporary directory (check TMPDIR): %v", err)
	}
	if keep {
		return made, func() {}, nil
	}
	return made, func() { removeAll(made) }, nil
}

func removeAll(dir string) {
	if err := os.RemoveAll(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		fmt.Fprintf(os.Stderr, "kube-harness: could not remove %s: %v\n", dir, err)
	}
}
