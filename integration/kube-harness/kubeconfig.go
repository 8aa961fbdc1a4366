package main

import (
	"fmt"
	"path/filepath"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

const contextName = "kube-harness"

// writeKubeconfig writes an admin kubeconfig that embeds the CA and the admin's
// certificate, so it keeps working when copied elsewhere.
func writeKubeconfig(dir, server string, p pkiFiles) (string, error) {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[contextName] = &clientcmdapi.Cluster{Server: server, CertificateAuthority: p.caCert}
	cfg.AuthInfos[contextName] = &clientcmdapi.AuthInfo{ClientCertificate: p.adminCert, ClientKey: p.adminKey}
	cfg.Contexts[contextName] = &clientcmdapi.Context{Cluster: contextName, AuthInfo: contextName, Namespace: "default"}
	cfg.CurrentContext = contextName
	if err := clientcmdapi.FlattenConfig(cfg); err != nil {
		return "", fmt.Errorf("embed credentials in kubeconfig: %v", err)
	}
	path := filepath.Join(dir, "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		return "", fmt.Errorf("write kubeconfig %s: %v", path, err)
	}
	return path, nil
}
