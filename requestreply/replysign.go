package requestreply

import (
	"crypto/hmac"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// MetricRepliesDropped counts the replies a requester dropped because their
// HeaderSignature was missing (motiu sense_signatura) or wrong
// (signatura_incorrecta): not the server's, or not for this request.
const MetricRepliesDropped = "km0_rr_client_replies_dropped_total"

// ReplyVerifier checks the HeaderSignature of the replies a requester
// receives (see SignReply). A dropped reply is counted (Dropped,
// MetricRepliesDropped) and logged at most once per reason per
// dropLogEvery, without its body; the request keeps waiting, for a genuine
// reply or its deadline. It is safe for concurrent use.
type ReplyVerifier struct {
	key     []byte
	log     *slog.Logger
	counter *prometheus.CounterVec
	dropped atomic.Int64

	mu     sync.Mutex
	logged map[string]time.Time
}

// dropLogEvery spaces the warnings about dropped replies, per reason.
const dropLogEvery = time.Minute

// NewReplyVerifier returns a ReplyVerifier for key, or nil (replies are not
// checked) when key is empty. It fails for a key CheckKey refuses, or if reg
// (nil: not registered) refuses MetricRepliesDropped. log defaults to
// slog.Default().
func NewReplyVerifier(key []byte, reg prometheus.Registerer, log *slog.Logger) (*ReplyVerifier, error) {
	if len(key) == 0 {
		return nil, nil
	}
	if err := CheckKey(key); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	c, err := registerCounter(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: MetricRepliesDropped,
		Help: "Replies dropped by a km0 requester for a missing or wrong " + HeaderSignature + ", by motiu.",
	}, []string{"motiu"}))
	if err != nil {
		return nil, err
	}
	return &ReplyVerifier{key: key, log: log, counter: c, logged: map[string]time.Time{}}, nil
}

// check reports whether r carries SignReply's signature for request id,
// correlation id corr and reply address replyTo; if not it counts and logs
// the drop. A nil v accepts every reply.
func (v *ReplyVerifier) check(id, corr, replyTo string, r Reply) bool {
	if v == nil {
		return true
	}
	motiu := ""
	switch {
	case r.Signature == "":
		motiu = ReasonUnsigned
	case !hmac.Equal([]byte(r.Signature), []byte(SignReply(v.key, id, corr, replyTo, r.Result, r.Body))):
		motiu = ReasonBadSignature
	default:
		return true
	}
	v.dropped.Add(1)
	v.counter.WithLabelValues(motiu).Inc()
	now := time.Now()
	v.mu.Lock()
	last, seen := v.logged[motiu]
	logIt := !seen || now.Sub(last) >= dropLogEvery
	if logIt {
		v.logged[motiu] = now
	}
	v.mu.Unlock()
	if logIt {
		v.log.Warn("requestreply: reply dropped: not signed by the server (further drops for this reason are counted in "+MetricRepliesDropped+" and logged at most once a minute)",
			"motiu", motiu, "id_peticio", clipID(id), "correlation_id", clipID(corr))
	}
	return false
}

// Dropped returns how many replies v dropped (0 for a nil v).
func (v *ReplyVerifier) Dropped() int64 {
	if v == nil {
		return 0
	}
	return v.dropped.Load()
}
