package amqptest

import (
	"context"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/tlstest"
)

// TLSBroker is the machine's RabbitMQ behind a TLS proxy of the test.
type TLSBroker struct {
	// CA signed the proxy's certificate (for 127.0.0.1 and ServerName).
	CA *tlstest.CA
	// URL is amqps://guest:guest@<proxy>/ without TLS parameters.
	URL string
	// ServerName is a DNS name the certificate also holds.
	ServerName string
	// Proxy is the TLS listener.
	Proxy *tlstest.Proxied
}

// ServerNameDefault is the DNS name TLSBroker certificates hold besides
// 127.0.0.1.
const ServerNameDefault = "rabbitmq.km0.test"

// NewTLSBroker puts a TLS listener with a certificate of a new test CA in
// front of the plain broker of URL (the machine's, port 5672). When
// clientCert is set, the proxy asks for a client certificate signed by the
// same CA. It stops at cleanup.
func NewTLSBroker(t testing.TB, clientCert bool) *TLSBroker {
	t.Helper()
	Shared(t)
	u, err := url.Parse(URL())
	if err != nil || u.Scheme != "amqp" {
		t.Fatalf("amqptest: the TLS proxy needs a plain amqp:// broker URL (KM0_TEST_AMQP_URL)")
	}
	target := u.Host
	if u.Port() == "" {
		target += ":5672"
	}
	ca := tlstest.NewCA(t, "km0 test CA")
	b := &TLSBroker{CA: ca, ServerName: ServerNameDefault}
	pool := ca.Pool()
	if !clientCert {
		pool = nil
	}
	b.Proxy = tlstest.Proxy(t, target, ca.Server(t, "127.0.0.1", ServerNameDefault), pool)
	u.Scheme, u.Host = "amqps", b.Proxy.Addr
	b.URL = u.String()
	return b
}

// URLWithCA returns URL carrying the CA as amqp091's cacertfile parameter,
// which every dial of the suites (km0's and amqp091's own) honours.
func (b *TLSBroker) URLWithCA() string {
	u, _ := url.Parse(b.URL)
	q := u.Query()
	q.Set("cacertfile", b.CA.CertFile)
	u.RawQuery = q.Encode()
	if u.Path == "" {
		u.Path = "/"
	}
	return u.String()
}

// RunSuitesOverTLS runs the tests of this test binary that match pattern
// again, in a child process whose KM0_TEST_AMQP_URL is an amqps:// URL
// through a TLS proxy (NewTLSBroker), and fails with the child's output
// unless it passed, ran at least one test and connected through the proxy.
// The child gets timeout.
func RunSuitesOverTLS(t *testing.T, pattern string, timeout time.Duration) {
	t.Helper()
	b := NewTLSBroker(t, false)
	ctx, cancel := context.WithTimeout(context.Background(), timeout+30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run", pattern, "-test.count=1", "-test.v",
		"-test.timeout", timeout.String())
	cmd.Env = append(os.Environ(), "KM0_TEST_AMQP_URL="+b.URLWithCA())
	out, err := cmd.CombinedOutput()
	passed := len(regexp.MustCompile(`(?m)^--- PASS`).FindAll(out, -1))
	if err != nil || passed == 0 || !strings.Contains(string(out), "\nPASS\n") {
		t.Fatalf("the suites %s over amqps:// failed (%v; %d top-level tests passed):\n%s", pattern, err, passed, tailOf(out))
	}
	if b.Proxy.Accepted() == 0 {
		t.Fatalf("the suites %s passed without connecting through the TLS proxy", pattern)
	}
	t.Logf("%d top-level tests passed over amqps:// (%d TLS connections)", passed, b.Proxy.Accepted())
}

func tailOf(b []byte) string {
	if len(b) > 20000 {
		return "…" + string(b[len(b)-20000:])
	}
	return string(b)
}
