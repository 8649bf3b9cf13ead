// Package tlstest gives tests a certificate authority of their own (server
// and client certificates written as PEM files in the test's temporary
// directory) and a TLS proxy that puts a real TLS listener in front of a
// plain server of the machine (RabbitMQ on 5672, its management API on
// 15672).
package tlstest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// CA is a test certificate authority. Its certificate is at CertFile.
type CA struct {
	// CertFile is the CA certificate (PEM), what a client trusts.
	CertFile string
	cert     *x509.Certificate
	key      *ecdsa.PrivateKey
	dir      string
}

// NewCA creates a CA named cn whose files live in a temporary directory of t.
// It fails the test on any error.
func NewCA(t testing.TB, cn string) *CA {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          serial(t),
		Subject:               pkix.Name{CommonName: cn},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatalf("tlstest: CA: %v", err)
	}
	cert, _ := x509.ParseCertificate(der)
	ca := &CA{cert: cert, key: key, dir: t.TempDir()}
	ca.CertFile = ca.write(t, "ca.pem", "CERTIFICATE", der)
	return ca
}

// Pair is a certificate and its key, as files and loaded.
type Pair struct {
	CertFile, KeyFile string
	TLS               tls.Certificate
}

// Server issues a server certificate for hosts (IP addresses or DNS names).
func (ca *CA) Server(t testing.TB, hosts ...string) Pair {
	t.Helper()
	tmpl := ca.template(t, hosts[0])
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	return ca.issue(t, "server-"+hosts[0], tmpl)
}

// Client issues a client certificate whose common name is cn (for
// PostgreSQL's cert authentication, the user name).
func (ca *CA) Client(t testing.TB, cn string) Pair {
	t.Helper()
	tmpl := ca.template(t, cn)
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	return ca.issue(t, "client-"+cn, tmpl)
}

// Pool is a certificate pool holding the CA alone.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.cert)
	return p
}

func (ca *CA) template(t testing.TB, cn string) *x509.Certificate {
	return &x509.Certificate{
		SerialNumber: serial(t),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
	}
}

func (ca *CA) issue(t testing.TB, name string, tmpl *x509.Certificate) Pair {
	t.Helper()
	key := newKey(t)
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatalf("tlstest: issue %s: %v", name, err)
	}
	kb, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatalf("tlstest: key: %v", err)
	}
	p := Pair{CertFile: ca.write(t, name+".pem", "CERTIFICATE", der), KeyFile: ca.write(t, name+".key", "PRIVATE KEY", kb)}
	if p.TLS, err = tls.LoadX509KeyPair(p.CertFile, p.KeyFile); err != nil {
		t.Fatalf("tlstest: load %s: %v", name, err)
	}
	return p
}

func (ca *CA) write(t testing.TB, name, typ string, der []byte) string {
	t.Helper()
	path := filepath.Join(ca.dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatalf("tlstest: %v", err)
	}
	return path
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("tlstest: key: %v", err)
	}
	return key
}

func serial(t testing.TB) *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		t.Fatalf("tlstest: serial: %v", err)
	}
	return n
}

// Proxy listens with TLS (certificate server) on 127.0.0.1 at a free port
// and forwards each connection's plain bytes to target (host:port). When
// clientCAs is not nil, a client must present a certificate it signed. It
// stops at cleanup, closing every connection it carries.
func Proxy(t testing.TB, target string, server Pair, clientCAs *x509.CertPool) *Proxied {
	t.Helper()
	cfg := &tls.Config{Certificates: []tls.Certificate{server.TLS}, MinVersion: tls.VersionTLS12}
	if clientCAs != nil {
		cfg.ClientCAs, cfg.ClientAuth = clientCAs, tls.RequireAndVerifyClientCert
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatalf("tlstest: listen: %v", err)
	}
	p := &Proxied{Addr: ln.Addr().String()}
	var (
		mu    sync.Mutex
		conns = map[net.Conn]struct{}{}
		wg    sync.WaitGroup
	)
	track := func(c net.Conn) {
		mu.Lock()
		conns[c] = struct{}{}
		mu.Unlock()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			p.accepted.Add(1)
			out, err := net.DialTimeout("tcp", target, 5*time.Second)
			if err != nil {
				in.Close()
				continue
			}
			track(in)
			track(out)
			wg.Add(2)
			go pipe(&wg, out, in)
			go pipe(&wg, in, out)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return p
}

// Proxied is a running Proxy.
type Proxied struct {
	// Addr is host:port of the TLS listener.
	Addr     string
	accepted atomic.Int64
}

// Accepted counts the connections accepted so far (before their handshake).
func (p *Proxied) Accepted() int64 { return p.accepted.Load() }

// pipe copies src to dst, then closes both (the other direction ends too).
func pipe(wg *sync.WaitGroup, dst, src net.Conn) {
	defer wg.Done()
	_, _ = io.Copy(dst, src)
	dst.Close()
	src.Close()
}
