package main

import (
	"fmt"
	"net/url"
	"path/filepath"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

const etcdStartTimeout = time.Minute

// embeddedEtcd is a single-member etcd in this process, reachable on loopback only.
type embeddedEtcd struct {
	server    *embed.Etcd
	clientURL string
	errs      <-chan error
}

func startEtcd(dir string) (*embeddedEtcd, error) {
	ports, err := freeLoopbackPorts(2)
	if err != nil {
		return nil, err
	}
	clientPort, peerPort := ports[0], ports[1]
	clientURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", clientPort)}
	peerURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", peerPort)}

	cfg := embed.NewConfig()
	cfg.Name = "kube-harness"
	cfg.Dir = filepath.Join(dir, "etcd")
	cfg.ListenClientUrls = []url.URL{clientURL}
	cfg.AdvertiseClientUrls = []url.URL{clientURL}
	cfg.ListenPeerUrls = []url.URL{peerURL}
	cfg.AdvertisePeerUrls = []url.URL{peerURL}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	// etcd logs at error level when it is closed ("server closed"); failures that matter
	// reach us through StartEtcd, ReadyNotify and Err instead.
	cfg.LogLevel = "fatal"
	cfg.LogOutputs = []string{"stderr"}
	// A throwaway test store: durability across power loss buys nothing and fsync
	// dominates write latency on shared CI disks.
	cfg.UnsafeNoFsync = true

	server, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, fmt.Errorf("cannot start embedded etcd on 127.0.0.1:%d/%d: %v (if a port was taken meanwhile, just rerun)", clientPort, peerPort, err)
	}
	select {
	case <-server.Server.ReadyNotify():
	case err := <-server.Err():
		server.Close()
		return nil, fmt.Errorf("embedded etcd failed while starting: %v", err)
	case <-time.After(etcdStartTimeout):
		server.Server.Stop()
		server.Close()
		return nil, fmt.Errorf("embedded etcd was not ready after %s (is the disk under %s very slow or full?)", etcdStartTimeout, dir)
	}
	return &embeddedEtcd{server: server, clientURL: clientURL.String(), errs: server.Err()}, nil
}

func (e *embeddedEtcd) stop() {
	e.server.Close()
}
