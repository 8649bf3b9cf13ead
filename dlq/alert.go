package dlq

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/pause"
)

// Defaults of AlerterConfig.
const (
	WebhookTimeoutDefault  = 5 * time.Second
	WebhookAttemptsDefault = 3
	WebhookBackoffDefault  = time.Second
	WebhookQueueDefault    = 1024
	MaxClassesDefault      = 32
)

// AlerterConfig configures an Alerter. The zero value counts and logs, with
// no webhook.
type AlerterConfig struct {
	// Registerer receives the metrics. Default prometheus.DefaultRegisterer.
	// Registering twice (two Alerters, one registry) shares the counters.
	Registerer prometheus.Registerer
	// Logger gets one error-level line per dead letter. Default slog.Default().
	Logger *slog.Logger
	// WebhookURL, if set, receives a JSON Notice per dead letter (POST).
	WebhookURL string
	// WebhookTimeout bounds each POST. Default 5 s.
	WebhookTimeout time.Duration
	// WebhookAttempts is how many times a notice is tried. Default 3.
	WebhookAttempts int
	// WebhookBackoff is the wait before the second attempt, doubled after
	// each further one, each wait jittered down by up to a half. Default 1 s.
	WebhookBackoff time.Duration
	// WebhookQueue is how many notices may wait for delivery; when it is full
	// a notice is dropped (logged and counted), never waited for. Default 1024.
	WebhookQueue int
	// Client sends the webhook. Default a client with WebhookTimeout.
	Client *http.Client
	// MaxClasses bounds the distinct motiu labels per topic; further classes
	// are counted as "altres". Default 32.
	MaxClasses int
}

// Notice is the JSON body the webhook receives.
type Notice struct {
	Topic    string    `json:"topic"` // the original topic
	ID       string    `json:"id"`    // the letter's ID (km0 dlq show ID)
	EventID  string    `json:"id_esdeveniment"`
	Type     string    `json:"tipus"`
	Reason   string    `json:"motiu"`
	Attempts int       `json:"intents"`
	DLQTopic string    `json:"topic_dlq"`
	DeadAt   time.Time `json:"morta_en"`
}

// Alerter makes every dead letter visible: it increments
// km0_dlq_letters_total{topic, motiu} (motiu = the reason class), logs at
// error level with the letter's id and reason, and, with a webhook URL, posts
// a Notice from a background goroutine with a timeout and retries. A slow or
// failing webhook never blocks the caller. Safe for concurrent use.
type Alerter struct {
	cfg      AlerterConfig
	letters  *prometheus.CounterVec
	failures *prometheus.CounterVec
	refused  *prometheus.CounterVec

	mu      sync.Mutex
	classes map[string]map[string]bool

	queue   chan outgoing
	stop    chan struct{}
	done    chan struct{}
	closing sync.Once
}

// NewAlerter returns an Alerter. It fails for a webhook URL that is not an
// absolute http(s) URL, or if the registry holds a different metric under the
// same name.
func NewAlerter(cfg AlerterConfig) (*Alerter, error) {
	if cfg.Registerer == nil {
		cfg.Registerer = prometheus.DefaultRegisterer
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.WebhookTimeout <= 0 {
		cfg.WebhookTimeout = WebhookTimeoutDefault
	}
	if cfg.WebhookAttempts <= 0 {
		cfg.WebhookAttempts = WebhookAttemptsDefault
	}
	if cfg.WebhookBackoff <= 0 {
		cfg.WebhookBackoff = WebhookBackoffDefault
	}
	if cfg.WebhookQueue <= 0 {
		cfg.WebhookQueue = WebhookQueueDefault
	}
	if cfg.MaxClasses <= 0 {
		cfg.MaxClasses = MaxClassesDefault
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{Timeout: cfg.WebhookTimeout}
	}
	if cfg.WebhookURL != "" {
		u, err := url.Parse(cfg.WebhookURL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, fmt.Errorf("dlq: webhook URL must be an absolute http(s) URL")
		}
	}
	a := &Alerter{cfg: cfg, classes: map[string]map[string]bool{}}
	var err error
	a.letters, err = registerCounter(cfg.Registerer, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "km0_dlq_letters_total",
		Help: "Dead letters seen, by original topic and reason class (motiu up to its second ':').",
	}, []string{"topic", "motiu"}))
	if err != nil {
		return nil, err
	}
	a.failures, err = registerCounter(cfg.Registerer, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "km0_dlq_webhook_failures_total",
		Help: "Dead-letter notices the webhook never received: causa=error (all attempts failed) or cua_plena (queue full).",
	}, []string{"causa"}))
	if err != nil {
		return nil, err
	}
	a.refused, err = registerCounter(cfg.Registerer, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "km0_dlq_refused_total",
		Help: "Dead letters the index refused and set aside in cartes_refusades, by DLQ topic or queue.",
	}, []string{"topic"}))
	if err != nil {
		return nil, err
	}
	if cfg.WebhookURL != "" {
		a.queue = make(chan outgoing, cfg.WebhookQueue)
		a.stop = make(chan struct{})
		a.done = make(chan struct{})
		go a.deliver()
	}
	return a, nil
}

func registerCounter(r prometheus.Registerer, c *prometheus.CounterVec) (*prometheus.CounterVec, error) {
	err := r.Register(c)
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		existing, ok := are.ExistingCollector.(*prometheus.CounterVec)
		if !ok {
			return nil, fmt.Errorf("dlq: metric already registered with another type: %w", err)
		}
		return existing, nil
	}
	if err != nil {
		return nil, fmt.Errorf("dlq: register metric: %w", err)
	}
	return c, nil
}

// DeadLetter raises the alerts for one new dead letter. It never blocks on the
// webhook. Call it once per letter (the indexer does, for letters it indexes
// for the first time).
func (a *Alerter) DeadLetter(ctx context.Context, l *Letter) {
	a.letters.WithLabelValues(l.OriginalTopic, a.label(l.OriginalTopic, l.Class())).Inc()
	a.cfg.Logger.LogAttrs(ctx, slog.LevelError, "dlq: dead letter",
		slog.String("id", l.ID), slog.String("topic", l.OriginalTopic),
		slog.String("id_esdeveniment", l.EventID), slog.String("tipus", l.Type),
		slog.String("motiu", l.Reason), slog.Int("intents", l.Attempts))
	a.enqueue(outgoing{id: l.ID, body: Notice{Topic: l.OriginalTopic, ID: l.ID, EventID: l.EventID, Type: l.Type,
		Reason: l.Reason, Attempts: l.Attempts, DLQTopic: l.Topic, DeadAt: l.DeadAt}})
}

// Refused raises the alert of a letter the index refused and set aside
// (Refusal): it increments km0_dlq_refused_total{topic} (the DLQ topic or
// queue) and logs at error level with the letter's id and PostgreSQL's
// reason. Call it once per letter (Service.Sync and the Indexer do, the
// first time a letter is set aside). It sends no webhook notice.
func (a *Alerter) Refused(ctx context.Context, r Refusal) {
	a.refused.WithLabelValues(r.Topic).Inc()
	logRefused(ctx, a.cfg.Logger, r)
}

// outgoing is one queued webhook body (a Notice or a LagNotice) and the name
// its log lines use.
type outgoing struct {
	id   string
	body any
}

// enqueue queues o for the webhook without ever waiting.
func (a *Alerter) enqueue(o outgoing) {
	if a.queue == nil {
		return
	}
	select {
	case <-a.stop:
		a.failures.WithLabelValues("cua_plena").Inc()
	default:
		select {
		case a.queue <- o:
		default:
			a.failures.WithLabelValues("cua_plena").Inc()
			a.cfg.Logger.Warn("dlq: webhook queue full; notice dropped", "id", o.id)
		}
	}
}

// LagNotice is the JSON body the webhook receives when a lag stays over its
// threshold for the configured duration (Estat "alerta"), and once more when
// it is back under (Estat "resolta"). Avis is always "lag", which tells it
// from a dead-letter Notice.
type LagNotice struct {
	Avis          string    `json:"avis"`    // "lag"
	Estat         string    `json:"estat"`   // "alerta" or "resolta"
	Objecte       string    `json:"objecte"` // "grup <g>", "outbox <name>" or "cua <q>"
	Lag           int64     `json:"lag"`     // records, rows or ready messages
	OldestSeconds float64   `json:"antiguitat_s"`
	MaxLag        int64     `json:"llindar_lag,omitempty"`
	MaxAgeSeconds float64   `json:"llindar_antiguitat_s,omitempty"`
	Since         time.Time `json:"des_de"` // when it went over
	At            time.Time `json:"en"`
}

// Lag raises the alert n: an error-level log line (a warning when resolved)
// and, with a webhook URL, n posted like a dead-letter Notice (background,
// timeout, retries; never blocks).
func (a *Alerter) Lag(ctx context.Context, n LagNotice) {
	n.Avis = "lag"
	lvl := slog.LevelError
	if n.Estat == "resolta" {
		lvl = slog.LevelWarn
	}
	a.cfg.Logger.LogAttrs(ctx, lvl, "lag: "+n.Estat, slog.String("objecte", n.Objecte),
		slog.Int64("lag", n.Lag), slog.Float64("antiguitat_s", n.OldestSeconds), slog.Time("des_de", n.Since))
	a.enqueue(outgoing{id: n.Objecte, body: n})
}

// label bounds the motiu label values of one topic to MaxClasses.
func (a *Alerter) label(topic, class string) string {
	a.mu.Lock()
	defer a.mu.Unlock()
	seen := a.classes[topic]
	if seen == nil {
		seen = map[string]bool{}
		a.classes[topic] = seen
	}
	if seen[class] {
		return class
	}
	if len(seen) >= a.cfg.MaxClasses {
		return contract.OtherClass
	}
	seen[class] = true
	return class
}

func (a *Alerter) deliver() {
	defer close(a.done)
	for {
		select {
		case n := <-a.queue:
			a.send(n)
		case <-a.stop:
			// Drain what is queued, then stop.
			for {
				select {
				case n := <-a.queue:
					a.send(n)
				default:
					return
				}
			}
		}
	}
}

func (a *Alerter) send(n outgoing) {
	body, _ := json.Marshal(n.body) // a Notice or LagNotice always marshals
	var lastErr error
	for attempt := 1; attempt <= a.cfg.WebhookAttempts; attempt++ {
		retry, err := a.post(body)
		if err == nil {
			return
		}
		lastErr = err
		if !retry || attempt == a.cfg.WebhookAttempts {
			break
		}
		t := time.NewTimer(pause.Backoff(a.cfg.WebhookBackoff, 0, attempt))
		select {
		case <-t.C:
		case <-a.stop:
			t.Stop()
			// Shutting down: one last try happens on the next loop turn only
			// if attempts remain; do not wait for the backoff.
		}
	}
	a.failures.WithLabelValues("error").Inc()
	a.cfg.Logger.Warn("dlq: webhook did not take the notice", "id", n.id, "err", lastErr)
}

// post sends one notice; retry says whether another attempt may help.
func (a *Alerter) post(body []byte) (retry bool, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), a.cfg.WebhookTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, a.cfg.WebhookURL, bytes.NewReader(body))
	if err != nil {
		return false, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := a.cfg.Client.Do(req)
	if err != nil {
		// The *url.Error quotes the URL, whose path or query may be the
		// webhook's secret: keep only the cause.
		if ue := (*url.Error)(nil); errors.As(err, &ue) {
			err = fmt.Errorf("webhook %s: %w", ue.Op, ue.Err)
		}
		return true, err
	}
	resp.Body.Close()
	switch {
	case resp.StatusCode >= 200 && resp.StatusCode < 300:
		return false, nil
	case resp.StatusCode >= 500, resp.StatusCode == http.StatusTooManyRequests, resp.StatusCode == http.StatusRequestTimeout:
		return true, fmt.Errorf("webhook answered %s", resp.Status)
	default:
		return false, fmt.Errorf("webhook answered %s", resp.Status)
	}
}

// Close stops the webhook goroutine after it has delivered (or given up on)
// the queued notices, or when ctx ends, whichever comes first. Notices given
// after Close are counted as dropped. Safe to call more than once.
func (a *Alerter) Close(ctx context.Context) error {
	if a.queue == nil {
		return nil
	}
	a.closing.Do(func() { close(a.stop) })
	select {
	case <-a.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
