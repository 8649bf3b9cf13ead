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

// HeaderSignature is the request header (a km0 extension of CONTRACT.md's
// request/reply) that carries the requester's HMAC-SHA256 of the request,
// hex-encoded: see Sign. A server with a signing key refuses a request whose
// signature is missing or wrong without running its handler (see Verifier).
const HeaderSignature = "km0_signatura"

// SigningKeyEnv is the environment variable that holds the key shared by the
// requesters and the servers of a deployment (comandes and pagaments). It is
// read from the environment only (never a flag or a file in the repository)
// and never logged.
const SigningKeyEnv = "KM0_RR_HMAC_KEY"

// SigningKeyFromEnv returns the key in SigningKeyEnv, or nil when it is unset
// or empty (requests go unsigned and servers accept them).
func SigningKeyFromEnv() []byte {
	if k := os.Getenv(SigningKeyEnv); k != "" {
		return []byte(k)
	}
	return nil
}

// Sign returns HeaderSignature's value for a request to service (the queue
// or topic) with request id id, HeaderDeadline value deadline and body:
// HMAC-SHA256 with key over the four, each prefixed by its length (so no two
// different requests sign the same bytes), hex-encoded. A replay of a signed
// request to another service, with another id, deadline or body, fails to
// verify.
func Sign(key []byte, service, id, deadline string, body []byte) string {
	m := hmac.New(sha256.New, key)
	var n [8]byte
	for _, part := range [][]byte{[]byte(service), []byte(id), []byte(deadline), body} {
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		m.Write(n[:])
		m.Write(part)
	}
	return hex.EncodeToString(m.Sum(nil))
}

// ErrUnauthenticated is the error reply (not retryable) to a request that a
// Verifier refused: unsigned, or signed with another key or over other bytes.
var ErrUnauthenticated = errors.New("bad request: no autenticada: signatura absent o incorrecta (" + HeaderSignature + ")")

// MetricUnauthenticated counts the requests a Verifier refused, by queue
// (cua) and motiu (sense_signatura, signatura_incorrecta).
const MetricUnauthenticated = "km0_rr_server_unauthenticated_total"

// VerifierConfig configures a Verifier.
type VerifierConfig struct {
	// Key is the shared key; required (without one, serve the handler as
	// is and warn: see NewVerifier).
	Key []byte
	// Queue is the queue or topic served: part of the signed bytes. Required.
	Queue string
	// Registerer, if set, gets MetricUnauthenticated (shared with other
	// Verifiers registered on it).
	Registerer prometheus.Registerer
	Logger     *slog.Logger // default slog.Default()
}

// Verifier checks HeaderSignature before a handler runs.
type Verifier struct {
	cfg     VerifierConfig
	counter *prometheus.CounterVec
	refused atomic.Int64
}

// NewVerifier returns a Verifier for cfg. It fails without a key or queue,
// or if the Registerer refuses the metric.
func NewVerifier(cfg VerifierConfig) (*Verifier, error) {
	if len(cfg.Key) == 0 || cfg.Queue == "" {
		return nil, errors.New("requestreply: VerifierConfig needs a Key and a Queue")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: MetricUnauthenticated,
		Help: "Requests refused by a km0 request/reply server for a missing or wrong " + HeaderSignature + ", by queue (cua) and motiu.",
	}, []string{"cua", "motiu"})
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			existing, ok := (*prometheus.CounterVec)(nil), false
			if errors.As(err, &are) {
				existing, ok = are.ExistingCollector.(*prometheus.CounterVec)
			}
			if !ok {
				return nil, fmt.Errorf("requestreply: metrics: %w", err)
			}
			c = existing
		}
	}
	return &Verifier{cfg: cfg, counter: c}, nil
}

// Wrap returns h guarded by v: a request whose Signature is not Sign's of its
// queue, ID, Deadline and Body under the key gets the error reply
// ErrUnauthenticated (not retryable), is counted (Refused,
// MetricUnauthenticated) and logged without its body, and h does not run.
func (v *Verifier) Wrap(h Handler) Handler {
	return func(ctx context.Context, req *Request) ([]byte, error) {
		motiu := ""
		switch {
		case req.Signature == "":
			motiu = "sense_signatura"
		case !hmac.Equal([]byte(req.Signature), []byte(Sign(v.cfg.Key, v.cfg.Queue, req.ID, req.Deadline, req.Body))):
			motiu = "signatura_incorrecta"
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

func clipID(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
