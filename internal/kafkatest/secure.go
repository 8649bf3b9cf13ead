package kafkatest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/transport/kafka"
	"github.com/km0/km0/transport/kafka/kafkaembed"
)

// PKI is a test certificate authority with a server certificate for
// 127.0.0.1 and localhost and a client certificate, all written as PEM files
// in a directory of the test's own.
type PKI struct {
	CAFile     string // the authority's certificate
	CertFile   string // the server's certificate
	KeyFile    string // the server's key
	ClientCert string // a client certificate signed by the authority
	ClientKey  string // its key
	// Server is the broker's TLS config: the server certificate, and the
	// authority for client certificates (verified when given).
	Server *tls.Config
}

// PKIOptions change NewPKI's certificates.
type PKIOptions struct {
	// Expired makes the server certificate's validity end an hour ago.
	Expired bool
	// RequireClientCert makes Server refuse a client without a certificate
	// signed by the authority (mutual TLS).
	RequireClientCert bool
}

// NewPKI makes a fresh authority and its certificates (ECDSA P-256).
func NewPKI(t testing.TB, o PKIOptions) *PKI {
	t.Helper()
	dir := t.TempDir()
	caKey, caCert, caDER := newCA(t)
	p := &PKI{CAFile: filepath.Join(dir, "ca.pem"), CertFile: filepath.Join(dir, "server.pem"), KeyFile: filepath.Join(dir, "server-key.pem"),
		ClientCert: filepath.Join(dir, "client.pem"), ClientKey: filepath.Join(dir, "client-key.pem")}
	writePEM(t, p.CAFile, "CERTIFICATE", caDER)

	notAfter := time.Now().Add(24 * time.Hour)
	if o.Expired {
		notAfter = time.Now().Add(-time.Hour)
	}
	srv := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "kfake"},
		NotBefore: time.Now().Add(-48 * time.Hour), NotAfter: notAfter,
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, DNSNames: []string{"localhost"},
	}
	srvCert := issue(t, srv, caCert, caKey, p.CertFile, p.KeyFile)
	cli := &x509.Certificate{
		SerialNumber: big.NewInt(3), Subject: pkix.Name{CommonName: "km0-test-client"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	issue(t, cli, caCert, caKey, p.ClientCert, p.ClientKey)

	pool := x509.NewCertPool()
	pool.AddCert(caCert)
	p.Server = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{srvCert}, ClientCAs: pool, ClientAuth: tls.VerifyClientCertIfGiven}
	if o.RequireClientCert {
		p.Server.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return p
}

func newCA(t testing.TB) (*ecdsa.PrivateKey, *x509.Certificate, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "km0 test CA"},
		NotBefore: time.Now().Add(-48 * time.Hour), NotAfter: time.Now().Add(48 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return key, cert, der
}

// issue signs tmpl with the authority, writes the certificate and its key
// to certFile and keyFile, and returns them as a tls.Certificate.
func issue(t testing.TB, tmpl, ca *x509.Certificate, caKey *ecdsa.PrivateKey, certFile, keyFile string) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, certFile, "CERTIFICATE", der)
	writePEM(t, keyFile, "EC PRIVATE KEY", keyDER)
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}

func writePEM(t testing.TB, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// SecureConfig configures NewSecure.
type SecureConfig struct {
	// Mechanism is the SASL mechanism of the broker's one (super)user:
	// kafka.SASLPlain, SASLScramSHA256 or SASLScramSHA512. Empty: no SASL.
	Mechanism string
	// User and Password are that user's. Default "km0" and a fresh random
	// password.
	User, Password string
	// TLS serves TLS with PKI's server certificate (a fresh PKI when nil).
	TLS bool
	PKI *PKI
	// Topics are created at start (6 partitions each).
	Topics []string
	// GroupMinSessionTimeout: see kafkaembed.Config. Default 6 s.
	GroupMinSessionTimeout time.Duration
}

// Secure is a secured embedded broker and what a client needs to reach it.
type Secure struct {
	*kafkaembed.Broker
	PKI *PKI // nil without TLS
	// Security is a client configuration that connects (with the broker's
	// CA, user and password).
	Security kafka.Security
}

// NewSecure starts an embedded broker with SASL and/or TLS, closed at cleanup.
func NewSecure(t testing.TB, cfg SecureConfig) *Secure {
	t.Helper()
	s := &Secure{}
	var extra []kfake.Opt
	if cfg.Mechanism != "" {
		if cfg.User == "" {
			cfg.User = "km0"
		}
		if cfg.Password == "" {
			cfg.Password = rand.Text()
		}
		extra = append(extra, kfake.EnableSASL(), kfake.Superuser(cfg.Mechanism, cfg.User, cfg.Password))
		s.Security.SASLMechanism, s.Security.SASLUsername, s.Security.SASLPassword = cfg.Mechanism, cfg.User, cfg.Password
	}
	if cfg.TLS {
		s.PKI = cfg.PKI
		if s.PKI == nil {
			s.PKI = NewPKI(t, PKIOptions{})
		}
		extra = append(extra, kfake.TLS(s.PKI.Server))
		s.Security.TLS, s.Security.TLSCAFile = true, s.PKI.CAFile
	}
	s.Broker = NewWith(t, kafkaembed.Config{Topics: cfg.Topics, GroupMinSessionTimeout: cfg.GroupMinSessionTimeout, Extra: extra})
	return s
}

// Opts returns s.Security's kgo options, failing the test on an error.
func (s *Secure) Opts(t testing.TB) []kgo.Opt {
	t.Helper()
	opts, err := s.Security.Opts()
	if err != nil {
		t.Fatal(err)
	}
	return opts
}
