package amqp

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
)

// TLSFiles names the files of a TLS client configuration, as an operator
// gives them (km0's --amqp-tls-* flags). The zero value is "no settings".
type TLSFiles struct {
	// CAFile is a PEM file of the certificate authorities that sign the
	// server's certificate. Empty: the system's roots.
	CAFile string
	// CertFile and KeyFile are the client certificate and its key (PEM),
	// for a server that asks for one. Both or neither.
	CertFile, KeyFile string
	// ServerName is the name the server's certificate must hold. Empty: the
	// host of the URL dialled.
	ServerName string
}

// IsZero reports whether f names nothing.
func (f TLSFiles) IsZero() bool { return f == TLSFiles{} }

// Config loads f into a TLS client configuration that verifies the server
// (TLS 1.2 at least). A CA file that cannot be read or holds no
// certificate, a certificate without its key (or the reverse) and a pair
// that does not load are errors naming the file, never its content.
func (f TLSFiles) Config() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: f.ServerName}
	if f.CAFile != "" {
		pem, err := os.ReadFile(f.CAFile)
		if err != nil {
			return nil, fmt.Errorf("TLS CA file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("TLS CA file %s holds no PEM certificate", f.CAFile)
		}
		cfg.RootCAs = pool
	}
	switch {
	case f.CertFile == "" && f.KeyFile == "":
	case f.CertFile == "" || f.KeyFile == "":
		return nil, errors.New("a TLS client certificate needs both its certificate file and its key file")
	default:
		pair, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("TLS client certificate %s with key %s: %w", f.CertFile, f.KeyFile, err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}
