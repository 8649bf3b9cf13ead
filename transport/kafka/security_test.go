package kafka_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/kafkatest"
	"github.com/km0/km0/transport/kafka"
)

// pingWith pings b with sec, within a deadline far longer than a refusal
// takes, and returns the error.
func pingWith(t *testing.T, b *kafkatest.Secure, sec kafka.Security) error {
	t.Helper()
	opts, err := sec.Opts()
	if err != nil {
		t.Fatal(err)
	}
	cl, err := kafka.NewClient(b.Addrs(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return kafka.Ping(ctx, cl)
}

// requireCause fails unless err wraps ErrSecurity, names want, and is not
// a deadline (the refusal, not a timeout).
func requireCause(t *testing.T, err error, want string) {
	t.Helper()
	switch {
	case err == nil:
		t.Fatalf("ping succeeded, want an error naming %q", want)
	case errors.Is(err, context.DeadlineExceeded):
		t.Fatalf("ping timed out instead of naming the cause %q: %v", want, err)
	case !errors.Is(err, kafka.ErrSecurity):
		t.Fatalf("error does not wrap ErrSecurity: %v", err)
	case !strings.Contains(err.Error(), want):
		t.Fatalf("error %q does not name %q", err, want)
	}
	t.Logf("refused as it should be: %v", err)
}

func TestPingThroughSASLSSLAndPLAIN(t *testing.T) {
	t.Parallel()
	for _, cfg := range []kafkatest.SecureConfig{
		{Mechanism: kafka.SASLScramSHA512, TLS: true},
		{Mechanism: kafka.SASLScramSHA256, TLS: true},
		{Mechanism: kafka.SASLPlain},
		{TLS: true},
	} {
		b := kafkatest.NewSecure(t, cfg)
		if err := pingWith(t, b, b.Security); err != nil {
			t.Fatalf("%s: %v", b.Security, err)
		}
	}
}

func TestWrongPasswordFailsFastNamingSASL(t *testing.T) {
	t.Parallel()
	for _, mech := range []string{kafka.SASLScramSHA512, kafka.SASLPlain} {
		b := kafkatest.NewSecure(t, kafkatest.SecureConfig{Mechanism: mech, TLS: true})
		sec := b.Security
		sec.SASLPassword = "not-" + sec.SASLPassword
		err := pingWith(t, b, sec)
		requireCause(t, err, "SASL authentication failed")
		if strings.Contains(err.Error(), sec.SASLPassword) {
			t.Fatalf("the error quotes the password: %v", err)
		}
		sec = b.Security
		sec.SASLUsername = "nobody"
		requireCause(t, pingWith(t, b, sec), "SASL authentication failed")
	}
}

func TestUnknownCAFailsFastNamingX509(t *testing.T) {
	t.Parallel()
	b := kafkatest.NewSecure(t, kafkatest.SecureConfig{Mechanism: kafka.SASLScramSHA512, TLS: true})
	sec := b.Security
	sec.TLSCAFile = kafkatest.NewPKI(t, kafkatest.PKIOptions{}).CAFile // another authority
	err := pingWith(t, b, sec)
	requireCause(t, err, "signed by an authority not trusted")
	requireCause(t, err, "x509: certificate signed by unknown authority")
}

func TestExpiredCertificateFailsFastNamingX509(t *testing.T) {
	t.Parallel()
	b := kafkatest.NewSecure(t, kafkatest.SecureConfig{Mechanism: kafka.SASLScramSHA512, TLS: true,
		PKI: kafkatest.NewPKI(t, kafkatest.PKIOptions{Expired: true})})
	err := pingWith(t, b, b.Security)
	requireCause(t, err, "x509: certificate has expired")
}

// Mutual TLS: a broker that requires a client certificate refuses a
// client without one, naming the handshake, and accepts the CA's client.
func TestClientCertificateIsRequiredAndAccepted(t *testing.T) {
	t.Parallel()
	pki := kafkatest.NewPKI(t, kafkatest.PKIOptions{RequireClientCert: true})
	b := kafkatest.NewSecure(t, kafkatest.SecureConfig{Mechanism: kafka.SASLScramSHA512, TLS: true, PKI: pki})
	requireCause(t, pingWith(t, b, b.Security), "TLS")
	sec := b.Security
	sec.TLSCertFile, sec.TLSKeyFile = pki.ClientCert, pki.ClientKey
	if err := pingWith(t, b, sec); err != nil {
		t.Fatalf("with the client certificate: %v", err)
	}
}

// Skipping verification is explicit, connects to a broker whose
// certificate expired, and says so in the log.
func TestInsecureSkipVerifyConnectsAndWarns(t *testing.T) {
	t.Parallel()
	b := kafkatest.NewSecure(t, kafkatest.SecureConfig{Mechanism: kafka.SASLScramSHA512, TLS: true,
		PKI: kafkatest.NewPKI(t, kafkatest.PKIOptions{Expired: true})})
	var logged bytes.Buffer
	sec := b.Security
	sec.TLSCAFile, sec.TLSInsecureSkipVerify = "", true
	sec.Logger = slog.New(slog.NewTextHandler(&logged, nil))
	if err := pingWith(t, b, sec); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logged.String(), "level=WARN") || !strings.Contains(logged.String(), "NOT verified") {
		t.Fatalf("no warning logged: %q", logged.String())
	}
}
