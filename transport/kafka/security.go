package kafka

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/aws"
	"github.com/twmb/franz-go/pkg/sasl/oauth"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// SASL mechanisms of Security.SASLMechanism, spelt as Kafka spells them.
const (
	SASLPlain       = "PLAIN"
	SASLScramSHA256 = "SCRAM-SHA-256"
	SASLScramSHA512 = "SCRAM-SHA-512"
	SASLOAuthBearer = "OAUTHBEARER"
	SASLAWSMSKIAM   = "AWS_MSK_IAM"
)

// SASLMechanisms lists the mechanisms Security accepts.
var SASLMechanisms = []string{SASLPlain, SASLScramSHA256, SASLScramSHA512, SASLOAuthBearer, SASLAWSMSKIAM}

// ErrSecurity wraps a connection the brokers or this client refuse for
// reasons of TLS or SASL (an untrusted or expired certificate, a wrong
// password, an unknown mechanism), and a Security that cannot be built: no
// retry helps, the configuration must change.
var ErrSecurity = errors.New("kafka: security")

// Security is how km0 reaches a secured Kafka: TLS and SASL, the same for
// every client a program makes (producer, consumers, admin). The zero value
// is a plaintext connection without authentication (the embedded broker's).
// Opts turns it into kgo options; Validate reports every problem at once.
// Its String never contains a secret.
type Security struct {
	// TLS encrypts the connections. Default false; any of the TLS* fields
	// below turns it on too. The brokers' certificates are verified against
	// TLSCAFile, or the system's roots when it is empty.
	TLS bool
	// TLSCAFile is a PEM file of the certificate authorities trusted for the
	// brokers' certificates. Default none: the system's roots.
	TLSCAFile string
	// TLSCertFile and TLSKeyFile are a PEM client certificate and its key
	// (mutual TLS): both or neither. Default none.
	TLSCertFile, TLSKeyFile string
	// TLSServerName is the name checked in the brokers' certificates.
	// Default each broker's host name, as dialled.
	TLSServerName string
	// TLSInsecureSkipVerify accepts any certificate: the connection is
	// encrypted but not authenticated, anyone on the path can read it.
	// Default false; Opts logs a warning when it is set.
	TLSInsecureSkipVerify bool
	// SASLMechanism authenticates the client: one of SASLMechanisms, or
	// empty (default) for none.
	SASLMechanism string
	// SASLUsername is the user of PLAIN and SCRAM (required with them).
	SASLUsername string
	// SASLPassword is the password of PLAIN and SCRAM (required with them).
	// Never logged, never in String.
	SASLPassword string
	// SASLOAuthTokenFile is the file holding the OAUTHBEARER token
	// (required with it). It is read again for each new connection, so a
	// token refreshed in the file (by a sidecar, a Kubernetes projected
	// volume) is used from then on; an unreadable or empty file fails that
	// connection with an error naming the path.
	SASLOAuthTokenFile string
	// Getenv reads the AWS credentials of AWS_MSK_IAM (AWS_ACCESS_KEY_ID,
	// AWS_SECRET_ACCESS_KEY, optional AWS_SESSION_TOKEN), again for each
	// new connection. Default os.Getenv.
	Getenv func(string) string
	// Dialer, if set, opens the TCP connections (through a proxy, or a
	// test's gate); TLS then runs over them. Default kgo's dialer.
	Dialer func(ctx context.Context, network, addr string) (net.Conn, error)
	// Logger receives the warnings of Opts. Default slog.Default().
	Logger *slog.Logger
}

// tlsOn reports whether the connections use TLS: TLS or any TLS* setting.
func (s Security) tlsOn() bool {
	return s.TLS || s.TLSCAFile != "" || s.TLSCertFile != "" || s.TLSKeyFile != "" || s.TLSServerName != "" || s.TLSInsecureSkipVerify
}

// Enabled reports whether s asks for TLS or SASL.
func (s Security) Enabled() bool { return s.tlsOn() || s.SASLMechanism != "" }

// String describes s for logs and reports, without any secret: e.g.
// "SASL_SSL SCRAM-SHA-512 user km0 (CA /etc/km0/ca.pem)" or "PLAINTEXT".
func (s Security) String() string {
	proto := "PLAINTEXT"
	switch {
	case s.tlsOn() && s.SASLMechanism != "":
		proto = "SASL_SSL"
	case s.tlsOn():
		proto = "SSL"
	case s.SASLMechanism != "":
		proto = "SASL_PLAINTEXT"
	}
	parts := []string{proto}
	if s.SASLMechanism != "" {
		parts = append(parts, s.SASLMechanism)
		if s.SASLUsername != "" && (s.SASLMechanism == SASLPlain || strings.HasPrefix(s.SASLMechanism, "SCRAM-")) {
			parts = append(parts, "user "+s.SASLUsername)
		}
	}
	var tlsParts []string
	if s.TLSCAFile != "" {
		tlsParts = append(tlsParts, "CA "+s.TLSCAFile)
	}
	if s.TLSCertFile != "" {
		tlsParts = append(tlsParts, "client certificate "+s.TLSCertFile)
	}
	if s.TLSServerName != "" {
		tlsParts = append(tlsParts, "server name "+s.TLSServerName)
	}
	if s.TLSInsecureSkipVerify {
		tlsParts = append(tlsParts, "certificates NOT verified")
	}
	if len(tlsParts) > 0 {
		parts = append(parts, "("+strings.Join(tlsParts, ", ")+")")
	}
	return strings.Join(parts, " ")
}

func (s Security) getenv(k string) string {
	if s.Getenv != nil {
		return s.Getenv(k)
	}
	return os.Getenv(k)
}

// Validate reports every problem of s at once (errors.Join, each wrapping
// ErrSecurity): an unknown mechanism, a missing username, password, token
// file or AWS credential, a client certificate without its key. It reads
// no file; Opts does.
func (s Security) Validate() error {
	var errs []error
	bad := func(format string, a ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrSecurity}, a...)...))
	}
	if (s.TLSCertFile == "") != (s.TLSKeyFile == "") {
		bad("a TLS client certificate needs both the certificate file and the key file")
	}
	switch s.SASLMechanism {
	case "":
		if s.SASLUsername != "" || s.SASLPassword != "" || s.SASLOAuthTokenFile != "" {
			bad("SASL credentials given without a SASL mechanism (one of %s)", strings.Join(SASLMechanisms, ", "))
		}
	case SASLPlain, SASLScramSHA256, SASLScramSHA512:
		if s.SASLUsername == "" {
			bad("SASL %s needs a username", s.SASLMechanism)
		}
		if s.SASLPassword == "" {
			bad("SASL %s needs a password", s.SASLMechanism)
		}
	case SASLOAuthBearer:
		if s.SASLOAuthTokenFile == "" {
			bad("SASL OAUTHBEARER needs a token file")
		}
	case SASLAWSMSKIAM:
		if s.getenv("AWS_ACCESS_KEY_ID") == "" || s.getenv("AWS_SECRET_ACCESS_KEY") == "" {
			bad("SASL AWS_MSK_IAM needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment")
		}
	default:
		bad("unknown SASL mechanism %q (known: %s)", s.SASLMechanism, strings.Join(SASLMechanisms, ", "))
	}
	return errors.Join(errs...)
}

// Opts returns the kgo options of s: a TLS dialer and a SASL mechanism,
// none for the zero Security. It validates s, reads the CA and client
// certificate files (an unreadable file or one without a PEM certificate is
// an error naming the path), and logs a warning when certificates are not
// verified or a PLAIN password travels without TLS. Errors wrap ErrSecurity.
func (s Security) Opts() ([]kgo.Opt, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	log := s.Logger
	if log == nil {
		log = slog.Default()
	}
	var opts []kgo.Opt
	if s.tlsOn() {
		tc, err := s.tlsConfig()
		if err != nil {
			return nil, err
		}
		if s.TLSInsecureSkipVerify {
			log.Warn("kafka: TLS certificates of the brokers are NOT verified (insecure skip verify): anyone on the path can read and change the traffic")
		}
		if s.Dialer == nil {
			opts = append(opts, kgo.DialTLSConfig(tc))
		} else {
			opts = append(opts, kgo.Dialer(tlsOver(s.Dialer, tc)))
		}
	} else if s.Dialer != nil {
		opts = append(opts, kgo.Dialer(s.Dialer))
	}
	if s.SASLMechanism != "" {
		if s.SASLMechanism == SASLPlain && !s.tlsOn() {
			log.Warn("kafka: SASL PLAIN without TLS sends the password in clear")
		}
		opts = append(opts, kgo.SASL(s.mechanism()))
	}
	return opts, nil
}

func (s Security) tlsConfig() (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: s.TLSServerName, InsecureSkipVerify: s.TLSInsecureSkipVerify} //nolint:gosec // explicit, with a warning
	if s.TLSCAFile != "" {
		pem, err := os.ReadFile(s.TLSCAFile)
		if err != nil {
			return nil, fmt.Errorf("%w: TLS CA file: %w", ErrSecurity, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%w: TLS CA file %s holds no PEM certificate", ErrSecurity, s.TLSCAFile)
		}
		tc.RootCAs = pool
	}
	if s.TLSCertFile != "" {
		cert, err := tls.LoadX509KeyPair(s.TLSCertFile, s.TLSKeyFile)
		if err != nil { // names the files, never their content
			return nil, fmt.Errorf("%w: TLS client certificate %s and key %s: %w", ErrSecurity, s.TLSCertFile, s.TLSKeyFile, err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// tlsOver returns a dialer that runs TLS with tc over the connections of
// dial, checking the dialled host's name unless tc names the server (as
// kgo.DialTLSConfig does).
func tlsOver(dial func(ctx context.Context, network, addr string) (net.Conn, error), tc *tls.Config) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		raw, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		c := tc.Clone()
		if c.ServerName == "" {
			host, _, err := net.SplitHostPort(addr)
			if err != nil {
				raw.Close()
				return nil, fmt.Errorf("kafka: broker address %q: %w", addr, err)
			}
			c.ServerName = host
		}
		conn := tls.Client(raw, c)
		if err := conn.HandshakeContext(ctx); err != nil {
			raw.Close()
			return nil, err
		}
		return conn, nil
	}
}

func (s Security) mechanism() sasl.Mechanism {
	switch s.SASLMechanism {
	case SASLPlain:
		return plain.Auth{User: s.SASLUsername, Pass: s.SASLPassword}.AsMechanism()
	case SASLScramSHA256:
		return scram.Auth{User: s.SASLUsername, Pass: s.SASLPassword}.AsSha256Mechanism()
	case SASLScramSHA512:
		return scram.Auth{User: s.SASLUsername, Pass: s.SASLPassword}.AsSha512Mechanism()
	case SASLOAuthBearer:
		path := s.SASLOAuthTokenFile
		return oauth.Oauth(func(context.Context) (oauth.Auth, error) {
			tok, err := readToken(path)
			return oauth.Auth{Token: tok}, err
		})
	default: // SASLAWSMSKIAM, Validate saw to it
		return aws.ManagedStreamingIAM(func(context.Context) (aws.Auth, error) {
			a := aws.Auth{AccessKey: s.getenv("AWS_ACCESS_KEY_ID"), SecretKey: s.getenv("AWS_SECRET_ACCESS_KEY"), SessionToken: s.getenv("AWS_SESSION_TOKEN")}
			if a.AccessKey == "" || a.SecretKey == "" {
				return a, fmt.Errorf("%w: SASL AWS_MSK_IAM: AWS_ACCESS_KEY_ID or AWS_SECRET_ACCESS_KEY is not set", ErrSecurity)
			}
			return a, nil
		})
	}
}

// tokenFileMax bounds an OAUTHBEARER token file.
const tokenFileMax = 64 << 10

// readToken reads the token file at path: its content trimmed of white
// space. An unreadable, empty or too large file is an error naming the path.
func readToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	switch {
	case err != nil:
		return "", fmt.Errorf("%w: SASL OAUTHBEARER token file: %w", ErrSecurity, err)
	case len(b) > tokenFileMax:
		return "", fmt.Errorf("%w: SASL OAUTHBEARER token file %s is larger than %d KiB", ErrSecurity, path, tokenFileMax>>10)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", fmt.Errorf("%w: SASL OAUTHBEARER token file %s is empty", ErrSecurity, path)
	}
	return tok, nil
}

// Ping asks the brokers for their metadata (no topics) within ctx and
// classifies a failure: a refused TLS handshake or SASL authentication
// comes back wrapping ErrSecurity with the cause named ("SASL
// authentication failed", the x509 error of the certificate); any other
// failure (no broker answers, ctx done) as it is. Commands call it at start
// with a short deadline so that a wrong password is an error, not a hang.
func Ping(ctx context.Context, cl *kgo.Client) error {
	req := kmsg.NewPtrMetadataRequest()
	req.Topics = []kmsg.MetadataRequestTopic{}
	_, err := req.RequestWith(ctx, cl)
	if err == nil {
		return nil
	}
	return classify(err)
}

// classify wraps err in ErrSecurity when TLS or SASL caused it.
func classify(err error) error {
	var (
		unknownCA   x509.UnknownAuthorityError
		invalid     x509.CertificateInvalidError
		hostname    x509.HostnameError
		verify      *tls.CertificateVerificationError
		alert       tls.AlertError
		recordHdr   tls.RecordHeaderError
		opErr       *net.OpError
		kerrSASL    = errors.Is(err, kerr.SaslAuthenticationFailed)
		unsupported = errors.Is(err, kerr.UnsupportedSaslMechanism) || errors.Is(err, kerr.IllegalSaslState)
	)
	switch {
	case kerrSASL:
		return fmt.Errorf("%w: SASL authentication failed (wrong username or password, or a user the brokers do not know): %w", ErrSecurity, err)
	case unsupported:
		return fmt.Errorf("%w: SASL mechanism refused by the brokers: %w", ErrSecurity, err)
	case errors.As(err, &unknownCA):
		return fmt.Errorf("%w: TLS: the brokers' certificate is signed by an authority not trusted (set the CA file): %w", ErrSecurity, err)
	case errors.As(err, &invalid):
		return fmt.Errorf("%w: TLS: the brokers' certificate is not valid: %w", ErrSecurity, err)
	case errors.As(err, &hostname):
		return fmt.Errorf("%w: TLS: the brokers' certificate is not for this host (set the server name): %w", ErrSecurity, err)
	case errors.As(err, &verify):
		return fmt.Errorf("%w: TLS: the brokers' certificate was refused: %w", ErrSecurity, err)
	case errors.As(err, &alert), errors.As(err, &opErr) && opErr.Op == "remote error": // the broker's TLS alert
		return fmt.Errorf("%w: TLS: the brokers refused the handshake (a client certificate missing or not trusted?): %w", ErrSecurity, err)
	case errors.As(err, &recordHdr):
		return fmt.Errorf("%w: TLS: the brokers do not speak TLS on this port: %w", ErrSecurity, err)
	}
	return err
}
