package amqp_test

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/km0/km0/internal/amqptest"
	"github.com/km0/km0/internal/testkit"
	"github.com/km0/km0/internal/tlstest"
	"github.com/km0/km0/transport/amqp"
)

// The publisher and consumer conformance suites pass over amqps://, through a
// TLS listener (a proxy with a certificate of the test's own CA) in front of
// the machine's RabbitMQ.
func TestConformanceSuitesOverTLS(t *testing.T) {
	t.Parallel()
	amqptest.RunSuitesOverTLS(t, "^(TestPublisherConformance|TestConsumerConformance)$", 3*time.Minute)
}

// Config.TLS (from TLSFiles: the CA, a client certificate, a server name)
// connects to a broker that asks for a client certificate; a message goes
// through and back.
func TestDialOverTLSWithAClientCertificate(t *testing.T) {
	t.Parallel()
	b := amqptest.NewTLSBroker(t, true)
	client := b.CA.Client(t, "km0-relay")
	cfg, err := amqp.TLSFiles{CAFile: b.CA.CertFile, CertFile: client.CertFile, KeyFile: client.KeyFile, ServerName: b.ServerName}.Config()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	conn, err := amqp.Dial(ctx, amqp.Config{URL: b.URL, TLS: cfg, Name: "km0-test " + t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	q := amqptest.Name("t.tls")
	declareQueue(t, conn, q)
	err = conn.Do(ctx, func(ch *amqp091.Channel) error {
		return ch.PublishWithContext(ctx, "", q, true, false, amqp091.Publishing{Body: []byte("over TLS")})
	})
	if err != nil {
		t.Fatal(err)
	}
	var got []amqp091.Delivery
	testkit.Eventually(t, 10*time.Second, "the message back", func() bool {
		got = append(got, getAll(t, conn, q)...)
		return len(got) >= 1
	})

	if len(got) != 1 || string(got[0].Body) != "over TLS" {
		t.Fatalf("got %d messages, first %q", len(got), got[0].Body)
	}
	if b.Proxy.Accepted() < 1 {
		t.Fatal("no connection went through the TLS proxy")
	}
}

// A broker whose certificate another CA signed, a server name its
// certificate does not hold, a missing client certificate and TLS settings
// on a plain amqp:// URL each fail the first Dial at once, naming the cause.
func TestDialOverTLSFailsFastNamingTheCause(t *testing.T) {
	t.Parallel()
	b := amqptest.NewTLSBroker(t, true)
	client := b.CA.Client(t, "km0-relay")
	other := tlstest.NewCA(t, "another CA")
	load := func(f amqp.TLSFiles) *amqp.Config {
		cfg, err := f.Config()
		if err != nil {
			t.Fatal(err)
		}
		return &amqp.Config{URL: b.URL, TLS: cfg}
	}
	plain := *load(amqp.TLSFiles{CAFile: b.CA.CertFile})
	plain.URL = amqptest.URL()
	for _, c := range []struct {
		name string
		cfg  amqp.Config
		want string
	}{
		{"unknown CA", *load(amqp.TLSFiles{CAFile: other.CertFile, CertFile: client.CertFile, KeyFile: client.KeyFile}), "certificate signed by unknown authority"},
		{"wrong server name", *load(amqp.TLSFiles{CAFile: b.CA.CertFile, CertFile: client.CertFile, KeyFile: client.KeyFile, ServerName: "rabbitmq.elsewhere.test"}),
			"not rabbitmq.elsewhere.test"},
		// The broker's alert (TLS 1.3: after the client's handshake) or,
		// when the closed connection beat it, Dial's hint.
		{"no client certificate", *load(amqp.TLSFiles{CAFile: b.CA.CertFile}), "certificate required|may require a client certificate"},
		{"TLS on amqp://", plain, "use amqps://"},
	} {
		t.Run(c.name, func(t *testing.T) {
			start := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			c.cfg.Logger = nil
			conn, err := amqp.Dial(ctx, c.cfg)
			if err == nil {
				conn.Close()
				t.Fatal("Dial succeeded")
			}
			if !regexp.MustCompile(c.want).MatchString(err.Error()) {
				t.Fatalf("want an error naming %q, got: %v", c.want, err)
			}
			if strings.Contains(err.Error(), "guest:guest") {
				t.Fatalf("the error shows the password: %v", err)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Fatalf("failed after %v: want at once", d)
			}
		})
	}
}

// TLSFiles refuses a CA file without a certificate and half a client pair,
// naming the file, not its content.
func TestTLSFilesRefusesBadFiles(t *testing.T) {
	t.Parallel()
	ca := tlstest.NewCA(t, "km0 test CA")
	client := ca.Client(t, "u")
	for _, c := range []struct {
		f    amqp.TLSFiles
		want string
	}{
		{amqp.TLSFiles{CAFile: client.KeyFile}, client.KeyFile + " holds no PEM certificate"},
		{amqp.TLSFiles{CAFile: "/nonexistent/ca.pem"}, "/nonexistent/ca.pem"},
		{amqp.TLSFiles{CertFile: client.CertFile}, "both its certificate file and its key file"},
		{amqp.TLSFiles{CertFile: client.CertFile, KeyFile: ca.CertFile}, "TLS client certificate " + client.CertFile},
	} {
		if _, err := c.f.Config(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: want an error with %q, got %v", c.f, c.want, err)
		}
	}
}
