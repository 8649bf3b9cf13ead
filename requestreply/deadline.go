package requestreply

import (
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// HeaderDeadline is the request header that carries the requester's absolute
// deadline (CONTRACT.md): unix seconds as a decimal string, on both brokers.
// A server drops a request whose deadline has passed without running the
// handler: its requester has already given up (a *TimeoutError), and will
// retry with the same request id if it still wants the answer.
const HeaderDeadline = "no_despres"

// FormatDeadline renders t as HeaderDeadline's value: unix seconds with
// microseconds, e.g. "1789000000.250000".
func FormatDeadline(t time.Time) string {
	return strconv.FormatFloat(float64(t.UnixMicro())/1e6, 'f', 6, 64)
}

// ParseDeadline reads a HeaderDeadline value (any decimal number of unix
// seconds). ok is false for an empty or malformed value, which a server
// treats as no deadline (the request is served: bad input loses nothing).
func ParseDeadline(s string) (t time.Time, ok bool) {
	s = strings.TrimSpace(s)
	if s == "" {
		return time.Time{}, false
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) || f <= 0 || f > 1e12 {
		return time.Time{}, false
	}
	sec, frac := math.Modf(f)
	return time.Unix(int64(sec), int64(frac*1e9)), true
}

// Expired reports whether a request with deadline (ok says it has one) is
// past it at now.
func Expired(deadline time.Time, ok bool, now time.Time) bool {
	return ok && !now.Before(deadline)
}

// MetricServerRequests counts the requests a server finished, by queue (or
// topic) and resultat: respost (reply sent), error (error reply sent),
// caducat (expired: dropped unhandled), orfe (reply returned or refused: the
// client is gone), sense_resposta (unanswerable: no reply address, or the
// reply failed).
const MetricServerRequests = "km0_rr_server_requests_total"

// Result labels of MetricServerRequests.
const (
	ResReplied      = "respost"
	ResErrorReply   = "error"
	ResExpired      = "caducat"
	ResOrphaned     = "orfe"
	ResUnanswerable = "sense_resposta"
)

// ServerMetrics are a server's Prometheus collectors. They count even when
// nobody registers them.
type ServerMetrics struct {
	requests *prometheus.CounterVec
	queue    string
}

// NewServerMetrics returns the collectors of a server on queue, registered
// on reg when reg is not nil (a second server on the same queue shares the
// collector already registered). It fails only if reg refuses them.
func NewServerMetrics(reg prometheus.Registerer, queue string) (*ServerMetrics, error) {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: MetricServerRequests,
		Help: "Requests finished by a km0 request/reply server, by queue (cua) and resultat (respost, error, caducat, orfe, sense_resposta).",
	}, []string{"cua", "resultat"})
	c, err := registerCounter(reg, c)
	if err != nil {
		return nil, err
	}
	return &ServerMetrics{requests: c, queue: queue}, nil
}

// Count adds one request finished with result res.
func (m *ServerMetrics) Count(res string) { m.requests.WithLabelValues(m.queue, res).Inc() }
