package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"
)

// waitReady polls /readyz as the admin until it answers 200, the apiserver or etcd
// fails, the context ends, or the timeout passes.
func waitReady(ctx context.Context, server string, p pkiFiles, timeout time.Duration, apiserverDone <-chan error, etcdErrs <-chan error) error {
	client, err := adminHTTPClient(p)
	if err != nil {
		return err
	}
	deadline := time.After(timeout)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	last := "no answer yet"
	for {
		status, body, err := get(ctx, client, server+"/readyz")
		switch {
		case err != nil:
			last = err.Error()
		case status == http.StatusOK:
			return nil
		default:
			last = fmt.Sprintf("HTTP %d: %s", status, failedChecks(body))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("stopped before kube-apiserver was ready")
		case err := <-apiserverDone:
			return fmt.Errorf("kube-apiserver exited while starting: %v", err)
		case err := <-etcdErrs:
			return fmt.Errorf("etcd failed while kube-apiserver was starting: %v", err)
		case <-deadline:
			return fmt.Errorf("kube-apiserver was not ready after %s (last /readyz: %s); rerun with -v=2 to see its log, or raise --ready-timeout on a slow machine", timeout, last)
		case <-tick.C:
		}
	}
}

func adminHTTPClient(p pkiFiles) (*http.Client, error) {
	caPEM, err := os.ReadFile(p.caCert)
	if err != nil {
		return nil, err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(caPEM)
	cert, err := tls.LoadX509KeyPair(p.adminCert, p.adminKey)
	if err != nil {
		return nil, err
	}
	return &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{
			RootCAs:      roots,
			Certificates: []tls.Certificate{cert},
		}},
	}, nil
}

func get(ctx context.Context, client *http.Client, url string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"?verbose", nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	return resp.StatusCode, string(body), nil
}

// failedChecks keeps the "[-]... failed" lines of a verbose /readyz answer.
func failedChecks(body string) string {
	var failed []string
	for _, line := range strings.Split(body, "\n") {
		if strings.HasPrefix(line, "[-]") {
			failed = append(failed, strings.TrimPrefix(line, "[-]"))
		}
	}
	if len(failed) == 0 {
		return strings.TrimSpace(body)
	}
	return strings.Join(failed, "; ")
}
