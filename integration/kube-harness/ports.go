package main

import (
	"errors"
	"fmt"
	"net"
	"syscall"
)

// listenLoopback binds 127.0.0.1:port (0: any free port). The apiserver serves on this
// listener, so the port chosen here cannot be taken by someone else before it starts.
func listenLoopback(port int) (net.Listener, error) {
	if port < 0 || port > 65535 {
		return nil, fmt.Errorf("--port %d is not a TCP port; pass 1-65535, or 0 for any free port", port)
	}
	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err == nil {
		return ln, nil
	}
	if errors.Is(err, syscall.EADDRINUSE) {
		return nil, fmt.Errorf("port %d on 127.0.0.1 is already in use (another kube-harness or apiserver?): stop that process, pass another --port, or pass --port 0 to pick a free one", port)
	}
	if errors.Is(err, syscall.EACCES) {
		return nil, fmt.Errorf("not allowed to bind 127.0.0.1:%d: pass a port above 1023, or --port 0 to pick a free one", port)
	}
	return nil, fmt.Errorf("cannot listen on 127.0.0.1:%d: %v", port, err)
}

// freeLoopbackPorts asks the kernel for n distinct free ports and releases them. Each
// listener stays open until all n are chosen: a port released before the next is asked
// for can be handed out again, and etcd then gets the same port for its client and its
// peer URL and cannot bind the second. etcd binds its own listeners from URLs, so there
// is still a short window in which another process could take a port; etcd then fails
// to start with an error that names it.
func freeLoopbackPorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	for len(ports) < n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("cannot find a free loopback port for etcd: %v", err)
		}
		defer ln.Close()
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
