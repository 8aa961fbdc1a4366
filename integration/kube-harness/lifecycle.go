package main

import (
	"context"
	"encoding/json"
	"io"
	"os"
)

// readiness is the one line printed on stdout once the apiserver answers /readyz.
type readiness struct {
	Ready      bool   `json:"ready"`
	Kubeconfig string `json:"kubeconfig"`
	Server     string `json:"server"`
	Dir        string `json:"dir"`
	PID        int    `json:"pid"`
}

func announceReady(r readiness) error {
	line, err := json.Marshal(r)
	if err != nil {
		return err
	}
	_, err = os.Stdout.Write(append(line, '\n'))
	return err
}

// cancelOnStdinEOF returns a context cancelled when stdin closes: a parent that holds
// the write end of a pipe on our stdin takes the harness down with it whenever it
// exits, even when it is killed or panics, because the kernel closes that end.
func cancelOnStdinEOF(parent context.Context) context.Context {
	ctx, cancel := context.WithCancel(parent)
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	return ctx
}
