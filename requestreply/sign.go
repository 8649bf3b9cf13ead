package requestreply

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// HeaderSignature is the header (a km0 extension of CONTRACT.md's
// request/reply) that carries an HMAC-SHA256, hex-encoded: on a request the
// requester's (see Sign), on a reply the server's (see SignReply). A server
// with a signing key refuses a request whose signature is missing or wrong
// without running its handler (see Verifier); a requester with a key drops a
// reply whose signature is missing or wrong (see ReplyVerifier).
const HeaderSignature = "km0_signatura"

// SigningKeyEnv is the environment variable that holds the key shared by the
// requesters and the servers of a deployment (comandes and pagaments). It is
// read from the environment only (never a flag or a file in the repository)
// and never logged.
const SigningKeyEnv = "KM0_RR_HMAC_KEY"

// MinKeyBytes is the shortest signing key accepted (CheckKey): 32 bytes, the
// size of HMAC-SHA256's output.
const MinKeyBytes = 32

// ErrKeyTooShort is wrapped by CheckKey's error for a key shorter than
// MinKeyBytes.
var ErrKeyTooShort = fmt.Errorf("requestreply: signing key shorter than %d bytes", MinKeyBytes)

// CheckKey returns nil for no key (unsigned) or a key of at least
// MinKeyBytes, else an error wrapping ErrKeyTooShort that names the length
// (never the key).
func CheckKey(key []byte) error {
	if len(key) > 0 && len(key) < MinKeyBytes {
		return fmt.Errorf("%w: %s has %d bytes (generate one with: openssl rand -hex 32)", ErrKeyTooShort, SigningKeyEnv, len(key))
	}
	return nil
}

// SigningKeyFromEnv returns the key in SigningKeyEnv, or nil when it is unset
// or empty. It does not check the key's length: see CheckKey.
func SigningKeyFromEnv() []byte {
	if k := os.Getenv(SigningKeyEnv); k != "" {
		return []byte(k)
	}
	return nil
}

// Domain tags: a request's signature can never verify as a reply's, nor the
// other way round.
const (
	tagRequest = "km0 request v2"
	tagReply   = "km0 reply v2"
)

func mac(key []byte, parts ...[]byte) string {
	m := hmac.New(sha256.New, key)
	var n [8]byte
	for _, part := range parts {
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		m.Write(n[:])
		m.Write(part)
	}
	return hex.EncodeToString(m.Sum(nil))
}

// Sign returns HeaderSignature's value for a request to service (the queue
// or topic) with request id id, correlation id corr, reply address replyTo
// (reply_to over RabbitMQ, respondre_a over Kafka), HeaderDeadline value
// deadline and body: HMAC-SHA256 with key over a request tag and the six,
// each prefixed by its length (so no two different requests sign the same
// bytes), hex-encoded. A replay of a signed request to another service, with
// another id, correlation id, reply address, deadline or body, fails to
// verify.
func Sign(key []byte, service, id, corr, replyTo, deadline string, body []byte) string {
	return mac(key, []byte(tagRequest), []byte(service), []byte(id), []byte(corr), []byte(replyTo), []byte(deadline), body)
}

// SignReply returns HeaderSignature's value for the reply to request id with
// correlation id corr sent to replyTo, with HeaderResult value result and
// body: HMAC-SHA256 with key over a reply tag and the five, length-prefixed,
// hex-encoded. Servers with a key sign every reply, error replies included;
// a reply to another request, address or with another result or body fails
// to verify.
func SignReply(key []byte, id, corr, replyTo, result string, body []byte) string {
	return mac(key, []byte(tagReply), []byte(id), []byte(corr), []byte(replyTo), []byte(result), body)
}

// ErrUnauthenticated is the error reply (not retryable) to a request that a
// Verifier refused: unsigned, or signed with another key or over other bytes.
var ErrUnauthenticated = errors.New("bad request: unauthenticated: signature missing or wrong (" + HeaderSignature + ")")

// MetricUnauthenticated counts the requests a Verifier refused, by queue
// (cua) and motiu (sense_signatura, signatura_incorrecta).
const MetricUnauthenticated = "km0_rr_server_unauthenticated_total"

// Reasons (motiu label) of MetricUnauthenticated and MetricRepliesDropped.
const (
	ReasonUnsigned     = "sense_signatura"
	ReasonBadSignature = "signatura_incorrecta"
)

// VerifierConfig configures a Verifier.
type VerifierConfig struct {
	// Key is the shared key; required, at least MinKeyBytes.
	Key []byte
	// Queue is the queue or topic served: part of the signed bytes. Required.
	Queue string
	// Registerer, if set, gets MetricUnauthenticated (shared with other
	// Verifiers registered on it).
	Registerer prometheus.Registerer
	Logger     *slog.Logger // default slog.Default()
}

// Verifier checks HeaderSignature before a handler runs. The servers
// (amqprr, kafkarr) build one from their SigningKey; a Verifier alone does
// not sign the replies.
type Verifier struct {
	cfg     VerifierConfig
	counter *prometheus.CounterVec
	refused atomic.Int64
}

// NewVerifier returns a Verifier for cfg. It fails without a key or queue,
// for a key CheckKey refuses, or if the Registerer refuses the metric.
func NewVerifier(cfg VerifierConfig) (*Verifier, error) {
	if len(cfg.Key) == 0 || cfg.Queue == "" {
		return nil, errors.New("requestreply: VerifierConfig needs a Key and a Queue")
	}
	if err := CheckKey(cfg.Key); err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	c, err := registerCounter(cfg.Registerer, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: MetricUnauthenticated,
		Help: "Requests refused by a km0 request/reply server for a missing or wrong " + HeaderSignature + ", by queue (cua) and motiu.",
	}, []string{"cua", "motiu"}))
	if err != nil {
		return nil, err
	}
	return &Verifier{cfg: cfg, counter: c}, nil
}

// Wrap returns h guarded by v: a request whose Signature is not Sign's of its
// queue, ID, CorrelationID, ReplyTo, Deadline and Body under the key gets the
// error reply ErrUnauthenticated (not retryable), is counted (Refused,
// MetricUnauthenticated) and logged without its body, and h does not run.
func (v *Verifier) Wrap(h Handler) Handler {
	return func(ctx context.Context, req *Request) ([]byte, error) {
		motiu := ""
		switch {
		case req.Signature == "":
			motiu = ReasonUnsigned
		case !hmac.Equal([]byte(req.Signature), []byte(Sign(v.cfg.Key, v.cfg.Queue, req.ID, req.CorrelationID, req.ReplyTo, req.Deadline, req.Body))):
			motiu = ReasonBadSignature
		}
		if motiu != "" {
			v.refused.Add(1)
			v.counter.WithLabelValues(v.cfg.Queue, motiu).Inc()
			v.cfg.Logger.Warn("requestreply: request refused: not authenticated", "cua", v.cfg.Queue, "motiu", motiu, "id_peticio", clipID(req.ID))
			return nil, BadRequest(ErrUnauthenticated)
		}
		return h(ctx, req)
	}
}

// Refused returns how many requests v refused.
func (v *Verifier) Refused() int64 { return v.refused.Load() }

// registerCounter registers c on reg (nil: not registered) and returns it,
// or the counter of the same name already registered there.
func registerCounter(reg prometheus.Registerer, c *prometheus.CounterVec) (*prometheus.CounterVec, error) {
	if reg == nil {
		return c, nil
	}
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(*prometheus.CounterVec); ok {
				return existing, nil
			}
		}
		return nil, fmt.Errorf("requestreply: metrics: %w", err)
	}
	return c, nil
}

func clipID(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
