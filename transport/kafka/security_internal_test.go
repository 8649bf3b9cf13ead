package kafka

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSecurityValidateReportsEveryProblemAtOnce(t *testing.T) {
	t.Parallel()
	err := Security{SASLMechanism: SASLScramSHA512, TLSCertFile: "c.pem"}.Validate()
	if !errors.Is(err, ErrSecurity) {
		t.Fatalf("want ErrSecurity, got %v", err)
	}
	for _, want := range []string{"needs both the certificate file and the key file", "needs a username", "needs a password"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	for _, s := range []Security{
		{SASLMechanism: "GSSAPI"},
		{SASLPassword: "p"},
		{SASLMechanism: SASLOAuthBearer},
		{SASLMechanism: SASLAWSMSKIAM, Getenv: func(string) string { return "" }},
	} {
		if err := s.Validate(); !errors.Is(err, ErrSecurity) {
			t.Errorf("%+v: want ErrSecurity, got %v", s.SASLMechanism, err)
		}
	}
	if err := (Security{}).Validate(); err != nil {
		t.Fatalf("the zero Security is plaintext: %v", err)
	}
}

func TestSecurityStringNeverShowsThePassword(t *testing.T) {
	t.Parallel()
	s := Security{TLSCAFile: "/etc/ca.pem", SASLMechanism: SASLScramSHA512, SASLUsername: "km0", SASLPassword: "hunter2-secret"}
	got := s.String()
	if got != "SASL_SSL SCRAM-SHA-512 user km0 (CA /etc/ca.pem)" {
		t.Fatalf("String() = %q", got)
	}
	if strings.Contains(got, s.SASLPassword) {
		t.Fatal("String shows the password")
	}
	if got := (Security{}).String(); got != "PLAINTEXT" {
		t.Fatalf("zero String() = %q", got)
	}
}

// TestOAuthTokenIsReadAgainForEachConnection: a token rotated in its file
// is the one the next connection sends.
func TestOAuthTokenIsReadAgainForEachConnection(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "token")
	write := func(tok string) {
		if err := os.WriteFile(path, []byte(tok+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("token-one")
	m := Security{SASLMechanism: SASLOAuthBearer, SASLOAuthTokenFile: path}.mechanism()
	first := func() string {
		_, msg, err := m.Authenticate(context.Background(), "127.0.0.1:9092")
		if err != nil {
			t.Fatal(err)
		}
		return string(msg)
	}
	if got := first(); !strings.Contains(got, "auth=Bearer token-one\x01") {
		t.Fatalf("first message %q does not carry token-one", got)
	}
	write("token-two")
	if got := first(); !strings.Contains(got, "auth=Bearer token-two\x01") {
		t.Fatalf("after rotation the message %q does not carry token-two", got)
	}
	write("   ")
	if _, _, err := m.Authenticate(context.Background(), "127.0.0.1:9092"); !errors.Is(err, ErrSecurity) || !strings.Contains(err.Error(), path+" is empty") {
		t.Fatalf("an empty token file: want an error naming it, got %v", err)
	}
}

// TestAWSMSKIAMSignsWithTheEnvironmentCredentials: the mechanism is
// franz-go's sasl/aws, fed from AWS_ACCESS_KEY_ID and friends.
func TestAWSMSKIAMSignsWithTheEnvironmentCredentials(t *testing.T) {
	t.Parallel()
	env := map[string]string{"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "secret-example", "AWS_SESSION_TOKEN": "session-example"}
	s := Security{TLS: true, SASLMechanism: SASLAWSMSKIAM, Getenv: func(k string) string { return env[k] }}
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	m := s.mechanism()
	if m.Name() != "AWS_MSK_IAM" {
		t.Fatalf("mechanism %s", m.Name())
	}
	_, msg, err := m.Authenticate(context.Background(), "b-1.km0.abc123.c2.kafka.eu-west-1.amazonaws.com:9098")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"x-amz-credential":"AKIDEXAMPLE/`, `/eu-west-1/kafka-cluster/aws4_request"`, `"x-amz-security-token":"session-example"`} {
		if !strings.Contains(string(msg), want) {
			t.Errorf("signed payload %s lacks %s", msg, want)
		}
	}
	if strings.Contains(string(msg), "secret-example") {
		t.Fatal("the payload carries the secret key")
	}
}
