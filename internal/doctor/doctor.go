// Package doctor is `km0 doctor`'s checks of a deployment: the connections
// (TLS, SASL), PostgreSQL (version, wal_level, REPLICATION, slots, LISTEN
// through a pooler), the contract's Kafka topics and ACLs, and RabbitMQ (the
// management API, the broker's clock, the topology). Each check adds a
// Finding that, when it is not ok, says what to change; no finding holds a
// credential. The command parses the flags into a Config and prints the
// Report.
package doctor

import (
	"cmp"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/system"
	"github.com/km0/km0/transport/amqp"
	"github.com/km0/km0/transport/kafka"
)

// Results of a doctor check.
const (
	ResultOK   = "ok"
	ResultWarn = "WARN"
	ResultFail = "FAIL"
)

// Finding is one row of the doctor's report: what was checked, against
// what, the result with what was seen, and, when it is not ok, what to
// change. No field ever holds a credential.
type Finding struct {
	Check  string `json:"check"`
	Target string `json:"target"`
	Result string `json:"result"` // ok, WARN or FAIL
	Seen   string `json:"seen"`
	Fix    string `json:"fix,omitempty"`
}

// Report collects the findings in the order they were made.
type Report struct{ rows []Finding }

// Findings returns the findings in the order they were made.
func (r *Report) Findings() []Finding { return r.rows }

func (r *Report) ok(check, target, seen string) {
	r.rows = append(r.rows, Finding{Check: check, Target: target, Result: ResultOK, Seen: seen})
}

func (r *Report) warn(check, target, seen, fix string) {
	r.rows = append(r.rows, Finding{Check: check, Target: target, Result: ResultWarn, Seen: seen, Fix: fix})
}

func (r *Report) fail(check, target, seen, fix string) {
	r.rows = append(r.rows, Finding{Check: check, Target: target, Result: ResultFail, Seen: seen, Fix: fix})
}

// Failed counts the FAIL rows.
func (r *Report) Failed() int {
	n := 0
	for _, f := range r.rows {
		if f.Result == ResultFail {
			n++
		}
	}
	return n
}

// Print writes the findings as one aligned table (CHECK, TARGET, RESULT,
// WHAT TO CHANGE) and a summary line, or as a JSON array.
func (r *Report) Print(w io.Writer, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(r.rows)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CHECK\tTARGET\tRESULT\tWHAT TO CHANGE")
	for _, f := range r.rows {
		res := f.Result
		if f.Seen != "" {
			res += ": " + oneLine(f.Seen)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", f.Check, f.Target, res, cmp.Or(oneLine(f.Fix), "-"))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	warns := 0
	for _, f := range r.rows {
		if f.Result == ResultWarn {
			warns++
		}
	}
	_, err := fmt.Fprintf(w, "\n%d checks: %d failed, %d warnings\n", len(r.rows), r.Failed(), warns)
	return err
}

// oneLine keeps a table cell on one line.
func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// Config is what the checks need: the deployment's settings, as km0 up's
// flags give them.
type Config struct {
	DatabaseURL string
	RelayMode   string // system.RelayPolling or system.RelayCDC
	OutboxMode  string // outbox.ModeTable or outbox.ModeWAL
	ListenWait  time.Duration
	Brokers     []string
	// KafkaSecurity is the TLS and SASL of the Kafka connection.
	KafkaSecurity kafka.Security
	AMQPURL       string
	// AMQPTLS returns the TLS of the AMQP connection (nil: the system's
	// roots for amqps://); its error is reported as a finding.
	AMQPTLS       func() (*tls.Config, error)
	ManagementURL string // "off": the management API is not checked
	// ManagementClient is the HTTP client of the management API, with the
	// TLS of AMQPTLS. Default: a 5 s timeout, that TLS.
	ManagementClient func(tlsCfg *tls.Config) *http.Client
	System           system.Config     // what places the events (the RabbitMQ topology)
	Authorize        bool              // pagaments' authorisation queue is checked
	Principals       map[string]string // Kafka principals by service (ACLs)
	MaxSkew          time.Duration
	Timeout          time.Duration
	Logger           *slog.Logger

	kafkaTopics  []string // the domain topics on Kafka, renamed, with .retry and .dlq
	rabbitTopics []string // the domain topics whose events go to RabbitMQ, renamed
}

// Check runs the checks of cfg and returns their report. The error is for
// a Config that cannot be checked (no database, or no Kafka brokers while
// events or request/reply are on Kafka), before anything connects.
func Check(ctx context.Context, cfg Config) (*Report, error) {
	renames, evTopics := cfg.System.Topics, cfg.System.EventsByTopic
	for _, s := range system.Services {
		t, ok := system.Topics[s]
		if !ok {
			continue
		}
		name := cmp.Or(renames[t], t)
		if cmp.Or(evTopics[t], cfg.System.Events, system.EventsKafka) == system.EventsRabbitMQ {
			cfg.rabbitTopics = append(cfg.rabbitTopics, name)
			continue
		}
		cfg.kafkaTopics = append(cfg.kafkaTopics, name, contract.RetryTopic(name), contract.DLQName(name))
	}
	if len(cfg.rabbitTopics) > 0 && cfg.AMQPURL == "" {
		cfg.AMQPURL = amqp.URLDefault
	}
	if cfg.AMQPURL == "" { // request/reply over Kafka
		cfg.kafkaTopics = append(cfg.kafkaTopics, pagaments.AuthQueue, inventari.ReserveQueue)
	}
	needsKafka := len(cfg.kafkaTopics) > 0 || cfg.AMQPURL == ""
	if needsKafka && len(cfg.Brokers) == 0 {
		return nil, errors.New("no Kafka brokers: pass --brokers or set KM0_KAFKA_BROKERS (the deployment's events or request/reply are on Kafka)")
	}
	if cfg.DatabaseURL == "" {
		return nil, errors.New("no database: pass --database-url or set KM0_DATABASE_URL")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.AMQPTLS == nil {
		cfg.AMQPTLS = func() (*tls.Config, error) { return nil, nil }
	}
	if cfg.ManagementClient == nil {
		cfg.ManagementClient = managementClient
	}
	var r Report
	checkPostgres(ctx, &r, cfg)
	if len(cfg.Brokers) > 0 {
		checkKafka(ctx, &r, cfg)
	}
	if cfg.AMQPURL != "" {
		checkRabbitMQ(ctx, &r, cfg)
	}
	return &r, nil
}

// managementClient is the default Config.ManagementClient.
func managementClient(tlsCfg *tls.Config) *http.Client {
	c := &http.Client{Timeout: 5 * time.Second}
	if tlsCfg != nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = tlsCfg.Clone()
		c.Transport = tr
	}
	return c
}

// withTimeout runs fn under cfg.Timeout.
func (cfg Config) withTimeout(ctx context.Context, fn func(ctx context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	return fn(ctx)
}

// clockSkew adds the Finding of a server's clock, seen at server,
// against this host's, read at local (the middle of the round trip);
// resolution is the precision of the server's time.
func clockSkew(r *Report, check, target string, server, local time.Time, resolution, maxSkew time.Duration) {
	d := server.Sub(local)
	if d < 0 {
		d = -d
	}
	seen := fmt.Sprintf("%v off this host", d.Round(time.Millisecond))
	if d > maxSkew+resolution {
		r.fail(check, target, seen, "synchronise the clocks (NTP/chrony) of this host and the server: the retry delays, the request deadlines and the lag are measured across machines")
		return
	}
	r.ok(check, target, seen)
}
