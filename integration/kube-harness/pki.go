package main

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// serviceClusterIPRange is the Service CIDR; its first address is the "kubernetes"
// Service, which the serving certificate names like a real cluster's does.
const (
	serviceClusterIPRange = "10.96.0.0/16"
	kubernetesServiceIP   = "10.96.0.1"
	certValidity          = 7 * 24 * time.Hour
)

// pkiFiles are the paths of the generated credentials, all PEM.
type pkiFiles struct {
	caCert, caKey           string
	servingCert, servingKey string
	adminCert, adminKey     string
	serviceAccountKey       string // signs service-account tokens
	serviceAccountPub       string // verifies them
}

type keyPair struct {
	cert *x509.Certificate
	key  crypto.Signer
}

// writePKI generates a fresh CA, a serving certificate for loopback and the in-cluster
// names, an admin client certificate (group system:masters) and a service-account key,
// unless the directory already holds them.
func writePKI(dir string) (pkiFiles, error) {
	pkiDir := filepath.Join(dir, "pki")
	if err := os.MkdirAll(pkiDir, 0o700); err != nil {
		return pkiFiles{}, fmt.Errorf("cannot create %s: %v", pkiDir, err)
	}
	p := pkiFiles{
		caCert: filepath.Join(pkiDir, "ca.crt"), caKey: filepath.Join(pkiDir, "ca.key"),
		servingCert: filepath.Join(pkiDir, "apiserver.crt"), servingKey: filepath.Join(pkiDir, "apiserver.key"),
		adminCert: filepath.Join(pkiDir, "admin.crt"), adminKey: filepath.Join(pkiDir, "admin.key"),
		serviceAccountKey: filepath.Join(pkiDir, "sa.key"),
		serviceAccountPub: filepath.Join(pkiDir, "sa.pub"),
	}
	// A restart with the same --dir keeps the certificates and keys of the run before,
	// so clients and kubeconfigs made for that run keep working.
	if allExist(p.caCert, p.caKey, p.servingCert, p.servingKey, p.adminCert, p.adminKey,
		p.serviceAccountKey, p.serviceAccountPub) {
		return p, nil
	}

	ca, err := newCA()
	if err != nil {
		return p, err
	}
	serving, err := issue(ca, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
			"kubernetes.default.svc.cluster.local"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP(kubernetesServiceIP)},
	})
	if err != nil {
		return p, err
	}
	admin, err := issue(ca, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-harness-admin", Organization: []string{"system:masters"}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	if err != nil {
		return p, err
	}
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return p, fmt.Errorf("generate service-account key: %v", err)
	}

	for _, w := range []struct {
		pair      keyPair
		cert, key string
	}{{ca, p.caCert, p.caKey}, {serving, p.servingCert, p.servingKey}, {admin, p.adminCert, p.adminKey}} {
		if err := writeCert(w.cert, w.pair.cert); err != nil {
			return p, err
		}
		if err := writeKey(w.key, w.pair.key); err != nil {
			return p, err
		}
	}
	return p, writeServiceAccountKey(p, saKey)
}

// writeServiceAccountKey writes the key pair as kubeadm does: the apiserver reads the
// signing key as SEC1 ("EC PRIVATE KEY") and the verifying key as PKIX ("PUBLIC KEY").
func writeServiceAccountKey(p pkiFiles, key *ecdsa.PrivateKey) error {
	private, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return fmt.Errorf("encode service-account key: %v", err)
	}
	public, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		return fmt.Errorf("encode service-account public key: %v", err)
	}
	if err := writePEM(p.serviceAccountKey, &pem.Block{Type: "EC PRIVATE KEY", Bytes: private}); err != nil {
		return err
	}
	return writePEM(p.serviceAccountPub, &pem.Block{Type: "PUBLIC KEY", Bytes: public})
}

func newCA() (keyPair, error) {
	return selfSign(&x509.Certificate{
		Subject:               pkix.Name{CommonName: "kube-harness-ca"},
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
	})
}

func selfSign(template *x509.Certificate) (keyPair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return keyPair{}, fmt.Errorf("generate CA key: %v", err)
	}
	if err := fillValidity(template); err != nil {
		return keyPair{}, err
	}
	der, err := x509.CreateCertificate(rand.Reader, template, template, key.Public(), key)
	if err != nil {
		return keyPair{}, fmt.Errorf("self-sign %s: %v", template.Subject.CommonName, err)
	}
	cert, err := x509.ParseCertificate(der)
	return keyPair{cert: cert, key: key}, err
}

func issue(ca keyPair, template *x509.Certificate) (keyPair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return keyPair{}, fmt.Errorf("generate key for %s: %v", template.Subject.CommonName, err)
	}
	if err := fillValidity(template); err != nil {
		return keyPair{}, err
	}
	template.KeyUsage = x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment
	der, err := x509.CreateCertificate(rand.Reader, template, ca.cert, key.Public(), ca.key)
	if err != nil {
		return keyPair{}, fmt.Errorf("sign %s: %v", template.Subject.CommonName, err)
	}
	cert, err := x509.ParseCertificate(der)
	return keyPair{cert: cert, key: key}, err
}

func fillValidity(template *x509.Certificate) error {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return fmt.Errorf("generate serial: %v", err)
	}
	template.SerialNumber = serial
	template.NotBefore = time.Now().Add(-time.Minute)
	template.NotAfter = time.Now().Add(certValidity)
	return nil
}

func writeCert(path string, cert *x509.Certificate) error {
	return writePEM(path, &pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw})
}

func writeKey(path string, key crypto.Signer) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return fmt.Errorf("encode key %s: %v", path, err)
	}
	return writePEM(path, &pem.Block{Type: "PRIVATE KEY", Bytes: der})
}

func writePEM(path string, block *pem.Block) error {
	if err := os.WriteFile(path, pem.EncodeToMemory(block), 0o600); err != nil {
		return fmt.Errorf("write %s: %v", path, err)
	}
	return nil
}

// allExist reports whether every one of paths exists.
func allExist(paths ...string) bool {
	for _, path := range paths {
		if _, err := os.Stat(path); err != nil {
			return false
		}
	}
	return true
}
